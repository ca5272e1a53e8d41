"""The ISAs a kernel grid runs in the default set, and the ones it leaves to the slow set.

Every runnable ISA of the host is tested against the scalar reference; `.ci/run` runs both sets, so
CI still covers them all. The README's command (the default set) covers the three that matter most
to a user of this host: the scalar reference, ``avx2`` (what every x86-64 user since 2013 runs and
the CPU class of most desktops and laptops) and the host's ``native`` target (what `infeng compile`
builds here). The other variants of the host (on AVX-512: ``avx512`` and ``avx512-vnni`` beside
``avx512-bf16``) and the AMX emulation each cost a kernel grid's compile (10-45 s on 2 cores) and
run in the slow set.
"""
from __future__ import annotations

import pytest

from infeng_compiler.codegen.target import native_target

DEFAULT_SET = frozenset({"scalar", "avx2", native_target().name})


def isa_params(isas: list[str]) -> list:
    """``isas`` as pytest params, those outside DEFAULT_SET marked slow."""
    return [pytest.param(isa, id=isa, marks=() if isa in DEFAULT_SET else pytest.mark.slow) for isa in isas]

"""The C sources of one model library: every kernel (``kernels.library_sources``), the C ABI
header, and ``model.c`` (the forward step) rendered from ``templates/model.c.j2``."""
from __future__ import annotations

from importlib.resources import files

from .kernels import kernel_prototype, library_sources, render_template
from .lower import LoweredModel

ABI_HEADER = "infeng.h"
MODEL_SOURCE = "model.c"


def render_sources(lowered: LoweredModel, profile: bool = False) -> tuple[dict[str, str], set[str]]:
    """(file name -> C text, names compiled without ISA flags). Nothing of the model's name or
    place goes into them, so the build cache hits for the same model anywhere.

    ``model.c`` only calls kernels, so it is compiled without ISA flags too: nothing in the
    library can execute a missing instruction before ``ife_cpu_check`` has run. ``profile``
    wraps every IR node's calls in timers (``infeng compile --profile``).
    """
    sources, baseline = library_sources(lowered.specs, lowered.target)
    sources[ABI_HEADER] = (files("infeng_templates") / ABI_HEADER).read_text()
    sources[MODEL_SOURCE] = render_template(
        "model.c.j2", target=lowered.target.name, c=lowered.constants, calls=lowered.calls,
        prototypes=[kernel_prototype(s) for s in lowered.specs],
        arena_floats_per_row=lowered.arena_floats_per_row, weights_bytes=lowered.weights_bytes,
        profile=profile, profile_entries=len(lowered.profile))
    return sources, baseline | {MODEL_SOURCE}

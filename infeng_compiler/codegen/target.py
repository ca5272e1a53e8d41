"""ISA targets: the cc flags a library is built with and the CPU features it needs to run.

Feature names use the /proc/cpuinfo spelling (``avx512_vnni``, ``amx_tile``). The environment
variable ``INFENG_CPU_FEATURES`` (comma-separated feature names) can only take features away from
the host's list, here and in the C check ``ife_cpu_check`` of every built library, so tests can
simulate a weaker CPU, never a stronger one. The AMX features count only where the kernel also
grants the tile data permission (the C check asks CPUID and XCR0 as well, docs/codegen.md).

``amx-emu`` builds the ``amx`` kernels with every tile instruction emulated in C (``IFE_AMX_EMULATE``
in ife_kernels.h), so their blocking, layouts and epilogues run and are tested on hosts without AMX;
it needs only ``avx512-bf16``'s features, is slow, and ``native`` never picks it.
"""
from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

from infeng_common.errors import UnsupportedError

#: Environment variable that overrides the host CPU feature list (comma-separated).
FEATURES_ENV = "INFENG_CPU_FEATURES"


@dataclass(frozen=True)
class Target:
    """One ISA: cc flags, the CPU features they need, and the target it extends."""

    name: str
    cflags: tuple[str, ...]
    features: tuple[str, ...]
    description: str
    base: str | None = None          # the next lower target (kernel templates fall back along it)
    emulated: bool = False           # instructions emulated in C: for tests, never picked by native

    def missing_features(self, host: frozenset[str] | None = None) -> list[str]:
        """The features this target needs that ``host`` (default: this machine) lacks."""
        have = host_features() if host is None else host
        return [f for f in self.features if f not in have]

    def lineage(self) -> list[str]:
        """This target's name followed by every lower one it extends, down to ``scalar``."""
        names, name = [], self.name
        while name is not None:
            names.append(name)
            name = TARGETS[name].base
        return names


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX2_FEATURES = ("avx2", "fma", "f16c")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_FEATURES = _AVX2_FEATURES + ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_BF16_FLAGS = _AVX512_FLAGS + ("-mavx512vnni", "-mavx512bf16")
_BF16_FEATURES = _AVX512_FEATURES + ("avx512_vnni", "avx512_bf16")

TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("scalar", (), (), "portable C, no ISA extension (the reference kernels)"),
    Target("avx2", _AVX2_FLAGS, _AVX2_FEATURES,
           "AVX2 + FMA + F16C: 8-wide f32, f16 weights widened with vcvtph2ps", base="scalar"),
    Target("avx2-vnni", _AVX2_FLAGS + ("-mavxvnni",), _AVX2_FEATURES + ("avx_vnni",),
           "AVX2 + AVX-VNNI: the integer kernels' dot products with 8-lane vpdpbusd/vpdpwssd "
           "(float kernels as avx2)", base="avx2"),
    Target("avx512", _AVX512_FLAGS, _AVX512_FEATURES,
           "AVX-512 F/BW/DQ/VL: 16-wide f32, mask registers for remainders", base="avx2"),
    Target("avx512-vnni", _AVX512_FLAGS + ("-mavx512vnni",), _AVX512_FEATURES + ("avx512_vnni",),
           "AVX-512 + VNNI (vpdpbusd int8 dot products)", base="avx512"),
    Target("avx512-bf16", _BF16_FLAGS, _BF16_FEATURES,
           "AVX-512 + VNNI + BF16: bf16 weights multiplied with vdpbf16ps (activations rounded to bf16)",
           base="avx512-vnni"),
    Target("amx", _BF16_FLAGS + ("-mamx-tile", "-mamx-int8", "-mamx-bf16"),
           _BF16_FEATURES + ("amx_tile", "amx_int8", "amx_bf16"),
           "AVX-512 + AMX: steps of many token rows multiply int8 and bf16 tiles (tdpbsud, tdpbssd, "
           "tdpbf16ps); fewer rows take the avx512-bf16 kernels", base="avx512-bf16"),
    Target("amx-emu", _BF16_FLAGS + ("-DIFE_AMX_EMULATE",), _BF16_FEATURES,
           "the amx kernels with each tile instruction emulated in C, for tests on hosts without AMX "
           "(slow; never picked by native)", base="amx", emulated=True),
)}

#: Runnable targets, best first: what ``native_target`` walks (never an emulated one).
_PREFERENCE = ("amx", "avx512-bf16", "avx512-vnni", "avx512", "avx2-vnni", "avx2", "scalar")


#: AMX features (/proc/cpuinfo names): usable only with the kernel's tile data permission.
AMX_FEATURES = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
_SYS_ARCH_PRCTL = 158            # x86-64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def amx_permission_granted() -> bool:
    """Ask the kernel for the AMX tile data permission (Linux >= 5.16), as every AMX library does
    when it loads; False where it is refused or there is no such call."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long          # long syscall(long number, ...): every argument a long
        return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(_XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def host_features() -> frozenset[str]:
    """CPU features this machine can use: /proc/cpuinfo's flags (the kernel lists AMX only where it
    has enabled the tile state in XCR0), AMX only with the kernel's permission, and only those
    named in ``INFENG_CPU_FEATURES`` when it is set."""
    have = _cpuinfo_flags()
    if have & AMX_FEATURES and not amx_permission_granted():
        have -= AMX_FEATURES
    override = os.environ.get(FEATURES_ENV)
    if override is not None:
        have &= frozenset(f.strip() for f in override.split(",") if f.strip())
    return have


def native_target() -> Target:
    """The best runnable target whose features this host has."""
    have = host_features()
    for name in _PREFERENCE:
        if not TARGETS[name].missing_features(have):
            return TARGETS[name]
    raise AssertionError("the scalar target needs no feature")


def runnable_targets(host: frozenset[str] | None = None) -> list[str]:
    """The targets whose libraries run on ``host`` (default: this machine), without the emulated
    ones (their other kernels are their base target's: a test grid would run those twice)."""
    have = host_features() if host is None else host
    return [name for name, t in TARGETS.items() if not t.emulated and not t.missing_features(have)]


def get_target(name: str, *, for_running: bool = False) -> Target:
    """The target called ``name`` (``native`` picks the host's best).

    With ``for_running`` the target must also run here: one whose features the host lacks raises
    ``UnsupportedError``.
    """
    if name == "native":
        return native_target()
    try:
        target = TARGETS[name]
    except KeyError:
        raise UnsupportedError(f"unknown target {name!r}; choose one of: native, "
                               f"{', '.join(TARGETS)}") from None
    if for_running:
        check_runnable(target)
    return target


def check_runnable(target: Target) -> None:
    """Raise ``UnsupportedError`` unless libraries built for ``target`` can run on this host."""
    missing = target.missing_features()
    if missing:
        raise UnsupportedError(f"target {target.name!r} needs CPU features this host lacks: "
                               f"{', '.join(missing)}; pick --target native (here: {native_target().name})")

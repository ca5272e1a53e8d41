"""target.py and the C CPU check: host detection, the INFENG_CPU_FEATURES override (it only takes
features away), the AMX check (CPUID, XCR0, the kernel's permission: every branch on any host), unknown
targets, and amx / amx-emu."""
from __future__ import annotations

import os

import cffi
import pytest

from infeng_common.errors import UnsupportedError
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import (
    AMX_FEATURES,
    FEATURES_ENV,
    TARGETS,
    get_target,
    host_features,
    native_target,
    runnable_targets,
)

HOST = host_features()

AVX2 = "avx2,fma,f16c"
AVX512 = AVX2 + ",avx512f,avx512bw,avx512dq,avx512vl"


@pytest.mark.parametrize("features,expected", [
    ("", "scalar"),
    (AVX2, "avx2"),
    ("avx2,fma", "scalar"),                                  # no f16c: AVX2 target needs all three
    (AVX512, "avx512"),
    (AVX512 + ",avx512_vnni", "avx512-vnni"),
    (AVX512 + ",avx512_vnni,avx512_bf16", "avx512-bf16"),                              # amx-emu never native
    (AVX512 + ",avx512_vnni,avx512_bf16,amx_tile,amx_int8,amx_bf16", "amx"),
    (AVX512 + ",avx512_vnni,avx512_bf16,amx_tile,amx_int8", "avx512-bf16"),            # all three AMX units
])
def test_native_selection(monkeypatch: pytest.MonkeyPatch, features: str, expected: str):
    if not set(TARGETS[expected].features) <= HOST:
        pytest.skip(f"this host lacks {expected}'s features (the override only removes features)")
    monkeypatch.setenv(FEATURES_ENV, features)
    assert native_target().name == expected
    assert get_target("native").name == expected


def test_native_runs_on_this_host():
    target = native_target()
    assert not target.emulated and not target.missing_features(host_features())


def test_unknown_target():
    with pytest.raises(UnsupportedError, match="unknown target 'avx1024'.*avx512-bf16"):
        get_target("avx1024")


def test_amx_runs_only_where_usable():
    """amx runs where the host has all three AMX units (and the kernel's permission); elsewhere it
    is refused naming what is missing. amx-emu runs wherever avx512-bf16 does and finds the amx
    kernel templates first."""
    amx = get_target("amx")                                  # any host builds it
    if AMX_FEATURES <= HOST:
        assert get_target("amx", for_running=True) is amx
    else:
        with pytest.raises(UnsupportedError, match="needs CPU features this host lacks: .*amx_"):
            get_target("amx", for_running=True)
    emu = get_target("amx-emu")
    assert emu.emulated and emu.features == TARGETS["avx512-bf16"].features and "-DIFE_AMX_EMULATE" in emu.cflags
    assert emu.lineage()[:3] == ["amx-emu", "amx", "avx512-bf16"]
    assert "amx-emu" not in runnable_targets(HOST | AMX_FEATURES)
    if not emu.missing_features(HOST):
        assert get_target("amx-emu", for_running=True) is emu


def test_override_only_removes_features(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(FEATURES_ENV, "avx2,fma,made_up_feature,amx_tile,amx_int8,amx_bf16")
    have = host_features()
    assert "made_up_feature" not in have and "f16c" not in have
    assert have <= {"avx2", "fma", "amx_tile", "amx_int8", "amx_bf16"} and have <= HOST
    assert bool(have & AMX_FEATURES) == bool(HOST & AMX_FEATURES)


def test_amx_features_need_the_kernels_permission(monkeypatch: pytest.MonkeyPatch):
    from infeng_compiler.codegen import target

    monkeypatch.setattr(target, "_cpuinfo_flags", lambda: frozenset({"avx2", "amx_tile", "amx_int8", "amx_bf16"}))
    monkeypatch.delenv(FEATURES_ENV, raising=False)
    monkeypatch.setattr(target, "amx_permission_granted", lambda: False)
    assert host_features() == {"avx2"}
    monkeypatch.setattr(target, "amx_permission_granted", lambda: True)
    assert host_features() == {"avx2"} | AMX_FEATURES


def test_missing_features_refused_for_running(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    with pytest.raises(UnsupportedError, match="avx512f, avx512bw, avx512dq, avx512vl"):
        get_target("avx512", for_running=True)


AMX_UNITS = (1 << 22) | (1 << 24) | (1 << 25)      # CPUID.(7,0):EDX amx_bf16, amx_tile, amx_int8
TILE_STATE = (1 << 17) | (1 << 18)                 # XCR0 XTILECFG, XTILEDATA


@pytest.fixture(scope="module")
def amx_library():
    target = TARGETS["amx"]
    specs = [KernelSpec.make("rms_norm", "amx", H=64, eps=1e-5)]
    sources, baseline = library_sources(specs, target)
    ffi = cffi.FFI()
    ffi.cdef(cdef(specs) + "const char *ife_amx_missing(uint32_t cpuid7_edx, uint64_t xcr0, long permission_rc);"
                           "const char *ife_amx_unusable(void);")
    return ffi, ffi.dlopen(str(build_library(sources, target, baseline_sources=baseline).path))


def test_amx_check_names_the_missing_piece(amx_library):
    """Each of CPUID, XCR0 and the kernel's permission, missing alone, is named (on any host)."""
    ffi, lib = amx_library

    def missing(edx: int, xcr0: int, rc: int) -> str:
        return ffi.string(lib.ife_amx_missing(edx, xcr0, rc)).decode()

    assert missing(AMX_UNITS, TILE_STATE | 0xE7, 0) == ""
    assert "CPUID" in missing(AMX_UNITS & ~(1 << 25), TILE_STATE, 0)
    assert "amx_tile" in missing(0, TILE_STATE, 0)
    assert "XCR0" in missing(AMX_UNITS, 1 << 17, 0)
    assert "XCR0" in missing(AMX_UNITS, 0, 0)
    assert "permission" in missing(AMX_UNITS, TILE_STATE, -1)


def test_amx_check_tells_the_truth_about_this_host(monkeypatch: pytest.MonkeyPatch, amx_library):
    """The C probe agrees with target.py (which reads /proc/cpuinfo and asks for the permission),
    and the amx library's check refuses a host without AMX, or one whose AMX the override removes."""
    ffi, lib = amx_library
    monkeypatch.delenv(FEATURES_ENV, raising=False)
    usable = AMX_FEATURES <= HOST
    assert (ffi.string(lib.ife_amx_unusable()).decode() == "") == usable
    buf = ffi.new("char[256]")
    n = lib.ife_cpu_check(buf, 256)
    assert (n == 0) == (usable and not TARGETS["amx"].missing_features(HOST))
    if not usable:
        assert "amx" in ffi.string(buf).decode().lower()
    monkeypatch.setenv(FEATURES_ENV, ",".join(sorted(HOST - {"amx_bf16"})))
    assert lib.ife_cpu_check(buf, 256) > 0 and "amx_bf16" in ffi.string(buf).decode()


@pytest.fixture(scope="module")
def avx512_library():
    target = TARGETS["avx512"]
    specs = [KernelSpec.make("rms_norm", "avx512", H=64, eps=1e-5)]
    sources, baseline = library_sources(specs, target)
    ffi = cffi.FFI()
    ffi.cdef(cdef(specs))
    return ffi, ffi.dlopen(str(build_library(sources, target, baseline_sources=baseline).path))


def test_cpu_check_reports_missing_features(monkeypatch: pytest.MonkeyPatch, avx512_library):
    """A simulated AVX2-only CPU: the avx512 library's check names what is missing, without SIGILL."""
    ffi, lib = avx512_library
    if not set(TARGETS["avx512"].features) <= HOST:
        pytest.skip("this host has no AVX-512")
    missing = ffi.new("char[256]")
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    assert lib.ife_cpu_check(missing, 256) == 4
    assert ffi.string(missing).decode() == "avx512f,avx512bw,avx512dq,avx512vl"
    short = ffi.new("char[8]")                               # truncated, still terminated
    assert lib.ife_cpu_check(short, 8) == 4 and ffi.string(short).decode() == "avx512f"
    monkeypatch.setenv(FEATURES_ENV, AVX512)
    assert lib.ife_cpu_check(missing, 256) == 0 and ffi.string(missing) == b""
    assert ffi.string(lib.ife_target_name()) == b"avx512"


def test_cpu_check_reads_the_host(monkeypatch: pytest.MonkeyPatch, avx512_library):
    ffi, lib = avx512_library
    monkeypatch.delenv(FEATURES_ENV, raising=False)
    missing = ffi.new("char[256]")
    expected = TARGETS["avx512"].missing_features(host_features())
    assert lib.ife_cpu_check(missing, 256) == len(expected)
    assert ffi.string(missing).decode() == ",".join(expected)


def test_default_threads(avx512_library):
    _, lib = avx512_library
    assert 1 <= lib.ife_default_threads() <= (os.cpu_count() or 1)

"""target.py and the C CPU check: host detection, the INFENG_CPU_FEATURES override, unknown and
compile-only targets."""
from __future__ import annotations

import os

import cffi
import pytest

from infeng_common.errors import UnsupportedError
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import FEATURES_ENV, TARGETS, get_target, host_features, native_target

AVX2 = "avx2,fma,f16c"
AVX512 = AVX2 + ",avx512f,avx512bw,avx512dq,avx512vl"


@pytest.mark.parametrize("features,expected", [
    ("", "scalar"),
    (AVX2, "avx2"),
    ("avx2,fma", "scalar"),                                  # no f16c: AVX2 target needs all three
    (AVX512, "avx512"),
    (AVX512 + ",avx512_vnni", "avx512-vnni"),
    (AVX512 + ",avx512_vnni,avx512_bf16,amx_tile,amx_int8,amx_bf16", "avx512-bf16"),   # amx never native
])
def test_native_selection(monkeypatch: pytest.MonkeyPatch, features: str, expected: str):
    monkeypatch.setenv(FEATURES_ENV, features)
    assert native_target().name == expected
    assert get_target("native").name == expected


def test_native_runs_on_this_host():
    target = native_target()
    assert not target.compile_only and not target.missing_features(host_features())


def test_unknown_target():
    with pytest.raises(UnsupportedError, match="unknown target 'avx1024'.*avx512-bf16"):
        get_target("avx1024")


def test_amx_is_refused_for_running():
    amx = get_target("amx")                                  # fine for a compile check
    assert "compile-checked only" in amx.description
    with pytest.raises(UnsupportedError, match="can only be compile-checked here"):
        get_target("amx", for_running=True)


def test_missing_features_refused_for_running(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    with pytest.raises(UnsupportedError, match="avx512f, avx512bw, avx512dq, avx512vl"):
        get_target("avx512", for_running=True)


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

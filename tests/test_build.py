"""build.py: content-hash cache, concurrent builds of one library, compile errors that point at the
rendered file and line."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import cffi
import pytest

from infeng_compiler.codegen.build import OBJECTS_DIR, BuildError, build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import TARGETS

SPECS = [KernelSpec.make("add", "scalar", N=8)]


def small_library() -> tuple[dict[str, str], set[str]]:
    return library_sources(SPECS, TARGETS["scalar"])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INFENG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_second_build_is_a_cache_hit(cache: Path):
    sources, baseline = small_library()
    first = build_library(sources, TARGETS["scalar"], baseline_sources=baseline)
    second = build_library(sources, TARGETS["scalar"], baseline_sources=baseline)
    assert not first.cache_hit and second.cache_hit
    assert second.path == first.path and second.seconds < 0.1
    assert (first.path.parent / "src" / f"{SPECS[0].symbol}.c").is_file()      # rendered sources kept
    other = build_library(sources, TARGETS["avx2"], baseline_sources=baseline)   # flags are part of the key
    assert not other.cache_hit and other.path != first.path


def test_concurrent_builds_share_one_entry(cache: Path):
    script = textwrap.dedent("""
        from infeng_compiler.codegen.build import build_library
        from infeng_compiler.codegen.kernels import KernelSpec, library_sources
        from infeng_compiler.codegen.target import TARGETS
        sources, baseline = library_sources([KernelSpec.make("add", "scalar", N=8)], TARGETS["scalar"])
        print(build_library(sources, TARGETS["scalar"], baseline_sources=baseline).path)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    entries = sorted(e.name for e in cache.iterdir())
    assert entries == sorted([OBJECTS_DIR, Path(paths.pop()).parent.name])      # no temp dirs left behind
    assert all(o.suffix == ".o" and len(o.stem) == 64 for o in (cache / OBJECTS_DIR).iterdir())
    sources, baseline = small_library()
    library = build_library(sources, TARGETS["scalar"], baseline_sources=baseline)
    assert library.cache_hit
    ffi = cffi.FFI()
    ffi.cdef(cdef(SPECS))
    lib = ffi.dlopen(str(library.path))
    a, b, out = ffi.new("float[8]", [1.0] * 8), ffi.new("float[8]", [2.0] * 8), ffi.new("float[8]")
    getattr(lib, SPECS[0].symbol)(a, b, 1, out)
    assert list(out) == [3.0] * 8


def test_objects_are_shared_between_libraries(cache: Path):
    """A library that differs from a built one in one unit compiles that unit alone."""
    sources, baseline = small_library()
    build_library(sources, TARGETS["scalar"], baseline_sources=baseline)
    objects = set((cache / OBJECTS_DIR).iterdir())
    extra = KernelSpec.make("add", "scalar", N=16)
    more_sources, more_baseline = library_sources([*SPECS, extra], TARGETS["scalar"])
    assert set(more_sources) - set(sources) == {f"{extra.symbol}.c"}
    library = build_library(more_sources, TARGETS["scalar"], baseline_sources=more_baseline)
    assert not library.cache_hit
    assert len(set((cache / OBJECTS_DIR).iterdir()) - objects) == 1


def test_compile_error_names_file_and_line(cache: Path):
    sources, baseline = small_library()
    name = f"{SPECS[0].symbol}.c"
    lines = sources[name].splitlines()
    bad_line = len(lines)                                   # the closing brace of the kernel
    lines[bad_line - 1] = "    undeclared_thing = 1; }"
    sources[name] = "\n".join(lines) + "\n"
    with pytest.raises(BuildError) as info:
        build_library(sources, TARGETS["scalar"], baseline_sources=baseline)
    message = str(info.value)
    assert f"{name}:{bad_line}: error:" in message and "undeclared_thing" in message
    kept = next(p for p in message.split() if p.endswith(f"{name}:{bad_line}:"))[: -len(f":{bad_line}:")]
    assert Path(kept).is_file()                             # the path in the message is real


def test_bad_source_names_are_refused(cache: Path):
    with pytest.raises(BuildError, match="plain"):
        build_library({"../escape.c": "int x;"}, TARGETS["scalar"])
    with pytest.raises(BuildError, match="baseline"):
        build_library({"a.c": "int x;"}, TARGETS["scalar"], baseline_sources={"b.c"})


def test_precompiled_header_gives_the_same_objects_and_is_not_kept(cache: Path, tmp_path: Path):
    """Enough units that include ife_kernels.h first get it precompiled (gcc): the objects are the
    ones a build without it makes, every unit is reported to ``progress``, and no .gch is published."""
    specs = [KernelSpec.make("add", "scalar", N=n) for n in (8, 16, 24, 32, 40)]
    sources, baseline = library_sources(specs, TARGETS["scalar"])
    seen: list[tuple[int, int]] = []
    library = build_library(sources, TARGETS["scalar"], baseline_sources=baseline,
                            progress=lambda done, total: seen.append((done, total)))
    units = [n for n in sources if n.endswith(".c")]
    assert seen == [(i, len(units)) for i in range(1, len(units) + 1)]
    assert not list(cache.rglob("*.gch")) and library.path.is_file()
    objects = {p.name: p.read_bytes() for p in (cache / OBJECTS_DIR).iterdir()}
    kernel = f"{specs[0].symbol}.c"
    (tmp_path / "plain").mkdir()
    for name, text in sources.items():
        (tmp_path / "plain" / name).write_text(text)
    from infeng_compiler.codegen.build import BASE_FLAGS, compiler

    flags = [*BASE_FLAGS, *TARGETS["scalar"].cflags]
    subprocess.run([*compiler(), *flags, "-c", str(tmp_path / "plain" / kernel), "-o", str(tmp_path / "plain.o")],
                   check=True)
    assert (tmp_path / "plain.o").read_bytes() in objects.values()

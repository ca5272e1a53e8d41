"""Compile rendered C sources into a shared library, cached by content hash.

A cache entry is ``<cache>/<sha256>/`` holding ``src/`` (the rendered sources, kept so that error
messages and debuggers point at real files) and ``libmodel.so``. The key covers every source, the
flags and the compiler's version, so a second build of the same model is a directory lookup.
Entries are built in a private temporary directory and published with one atomic ``os.replace``:
two processes building the same library at once both succeed and one of the two results is kept.

Object files are cached too, in ``<cache>/objects/<sha256>.o``, keyed by the unit's text, every
header, the unit's flags and the compiler's version: a library that differs from a built one in a
few units (another model of the same shapes, other adapter slots) compiles only those units.

Every unit is its own process, two or more at a time (one per core). With gcc, the header most
units include first (``ife_kernels.h``: immintrin.h and the shared helpers, most of a small unit's
compile time) is precompiled once per build (``<header>.gch`` beside it, which gcc reads instead of
the text when the flags match); the objects are the same byte for byte. The ``.gch`` is deleted
before the entry is published.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from infeng_common.errors import InfengError

from .target import Target

#: Flags for every translation unit. -ffp-contract=fast lets the scalar code use FMA (the
#: tolerance tests pass with it); -fno-math-errno lets sqrtf/expf inline. No -ffast-math.
BASE_FLAGS = ("-std=c11", "-O3", "-fPIC", "-pthread", "-ffp-contract=fast", "-fno-math-errno")
LINK_FLAGS = ("-shared", "-pthread")
LIBS = ("-lm",)
LIBRARY_NAME = "libmodel.so"
OBJECTS_DIR = "objects"
#: Units that must include one header first for precompiling it to pay (0.5 s once vs ~0.15 s a unit).
PCH_MIN_UNITS = 4
#: Compiler diagnostics shown in a BuildError, at most.
MAX_ERRORS_SHOWN = 5

_FIRST_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+\.h)"', re.MULTILINE)
_DIAGNOSTIC = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<msg>.*)$")


class BuildError(InfengError):
    """The C compiler or linker failed on rendered sources."""


@dataclass(frozen=True)
class BuildResult:
    path: Path            # the shared library
    cache_hit: bool
    seconds: float


def cache_root() -> Path:
    """``$INFENG_CACHE_DIR``, else ``$XDG_CACHE_HOME/infeng/build``, else ``~/.cache/infeng/build``."""
    explicit = os.environ.get("INFENG_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infeng" / "build"


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` (may carry arguments, e.g. ``ccache gcc``), default ``cc``."""
    return shlex.split(os.environ.get("CC", "cc"))


@lru_cache(maxsize=None)
def compiler_version(cc: tuple[str, ...]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"C compiler {' '.join(cc)!r} does not run ({e}); set $CC to a working cc") from None
    return out.stdout


def build_library(sources: dict[str, str], target: Target, *, baseline_sources: set[str] | frozenset[str] = frozenset(),
                  extra_flags: tuple[str, ...] = (),
                  progress: Callable[[int, int], None] | None = None) -> BuildResult:
    """Build ``sources`` (file name -> C text; ``.h`` files are written, ``.c`` files compiled).

    Sources named in ``baseline_sources`` are compiled without ``target``'s ISA flags (the CPU
    check must run on any CPU); the others with them. ``progress(done, total)`` hears each
    translation unit compiled.
    """
    start = time.perf_counter()
    unknown = set(baseline_sources) - set(sources)
    if unknown:
        raise BuildError(f"baseline sources {sorted(unknown)} are not among the sources")
    bad = [n for n in sources if not n.endswith((".c", ".h")) or os.path.basename(n) != n]
    if bad:
        raise BuildError(f"source names must be plain *.c or *.h file names, got {bad}")
    cc = tuple(compiler())
    isa_flags = (*BASE_FLAGS, *target.cflags, *extra_flags)
    baseline_flags = (*BASE_FLAGS, *extra_flags)
    key = _cache_key(sources, baseline_sources, cc, isa_flags, baseline_flags)
    root = cache_root()
    entry = root / key
    library = entry / LIBRARY_NAME
    if library.is_file():
        return BuildResult(library, True, time.perf_counter() - start)

    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=root))
    try:
        src = work / "src"
        src.mkdir()
        for name, text in sources.items():
            (src / name).write_text(text, encoding="utf-8")
        units = sorted(n for n in sources if n.endswith(".c"))
        unit_flags = {n: baseline_flags if n in baseline_sources else isa_flags for n in units}
        headers = {n: text for n, text in sources.items() if n.endswith(".h")}
        objects_dir = root / OBJECTS_DIR
        objects_dir.mkdir(exist_ok=True)
        objects = {n: objects_dir / f"{_object_key(n, sources[n], headers, cc, unit_flags[n])}.o" for n in units}
        missing = [n for n in units if not objects[n].is_file()]
        commands = {n: [*cc, *unit_flags[n], "-c", str(src / n), "-o", str(work / (n[:-2] + ".o"))]
                    for n in missing}
        _precompile_header(cc, src, {n: sources[n] for n in missing if unit_flags[n] == isa_flags}, headers,
                           isa_flags)
        results: dict[str, subprocess.CompletedProcess] = {}
        with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1))) as ex:
            running = {ex.submit(_run, command): n for n, command in commands.items()}
            for done in as_completed(running):
                results[running[done]] = done.result()
                if progress:
                    progress(len(results), len(missing))
        for pch in src.glob("*.gch"):
            pch.unlink()
        failed = [n for n in missing if results[n].returncode != 0]
        if failed:
            raise _compile_error(root, key, work, failed, results, commands, target)
        for n in missing:                  # published whole: a concurrent build sees a complete file or none
            os.replace(work / (n[:-2] + ".o"), objects[n])
        link = [*cc, *LINK_FLAGS, *extra_flags, "-o", str(work / LIBRARY_NAME), *map(str, objects.values()), *LIBS]
        linked = _run(link)
        if linked.returncode != 0:
            raise BuildError(f"linking {LIBRARY_NAME} for target {target.name} failed:\n"
                             f"{linked.stderr.strip()}\ncommand: {shlex.join(link)}")
        try:
            os.replace(work, entry)
        except OSError:
            if not library.is_file():      # not a concurrent build of the same key that got there first
                raise
        return BuildResult(library, False, time.perf_counter() - start)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _cache_key(sources: dict[str, str], baseline: set[str] | frozenset[str], cc: tuple[str, ...],
               isa_flags: tuple[str, ...], baseline_flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (" ".join(cc), compiler_version(cc), " ".join(isa_flags), " ".join(baseline_flags),
                 " ".join(LINK_FLAGS + LIBS), ",".join(sorted(baseline))):
        h.update(part.encode() + b"\0")
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return h.hexdigest()


def _object_key(name: str, text: str, headers: dict[str, str], cc: tuple[str, ...], flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (" ".join(cc), compiler_version(cc), " ".join(flags), name, text):
        h.update(part.encode() + b"\0")
    for header in sorted(headers):
        h.update(header.encode() + b"\0" + headers[header].encode() + b"\0")
    return h.hexdigest()


def _precompile_header(cc: tuple[str, ...], src: Path, units: dict[str, str], headers: dict[str, str],
                       flags: tuple[str, ...]) -> None:
    """With gcc, precompile the header that at least ``PCH_MIN_UNITS`` of ``units`` include first
    (as ``src/<header>.gch``, for ``flags``). A failure only costs the time: gcc falls back to the
    text of a header whose ``.gch`` is missing or does not match."""
    if "Free Software Foundation" not in compiler_version(cc):
        return
    first = [m.group(1) for m in map(_FIRST_INCLUDE.search, units.values()) if m]
    if not first:
        return
    header = max(set(first), key=first.count)
    if header not in headers or first.count(header) < PCH_MIN_UNITS:
        return
    _run([*cc, *flags, "-x", "c-header", str(src / header), "-o", str(src / f"{header}.gch")])


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _compile_error(root: Path, key: str, work: Path, failed: list[str], results: dict,
                   commands: dict[str, list[str]], target: Target) -> BuildError:
    """Keep the failed build in ``<cache>/<key>.failed/`` and say where each error is."""
    kept = root / f"{key}.failed"
    shutil.rmtree(kept, ignore_errors=True)
    try:
        os.replace(work, kept)
    except OSError:
        pass                               # a concurrent failure of the same sources got there first
    src = kept / "src"
    lines = [f"C compile failed for target {target.name} in {', '.join(failed)}:"]
    for name in failed:
        stderr = results[name].stderr.replace(str(work), str(kept))
        diagnostics = [m for m in map(_DIAGNOSTIC.match, stderr.splitlines()) if m]
        for m in diagnostics[:MAX_ERRORS_SHOWN]:
            file = src / os.path.basename(m["file"])
            line_no = int(m["line"])
            lines.append(f"  {file}:{line_no}: error: {m['msg']}")
            text = file.read_text(encoding="utf-8").splitlines() if file.is_file() else []
            if 0 < line_no <= len(text):
                lines.append(f"  {line_no:6d} | {text[line_no - 1].strip()}")
        if not diagnostics:
            lines.append(stderr.strip() or f"  {name}: compiler exited {results[name].returncode}")
    command = shlex.join(commands[failed[0]]).replace(str(work), str(kept))
    lines.append(f"rendered sources kept in {src}; command: {command}")
    return BuildError("\n".join(lines))

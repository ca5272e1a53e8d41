"""``infeng compile``: import -> passes -> lower -> render -> build -> write the artifact."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from infeng_common.errors import InfengError, ModelFormatError
from infeng_common.manifest import LIBRARY, WEIGHTS, file_sha256, is_artifact, read_manifest

from . import __version__
from .artifact import write_manifest, write_weights
from .codegen.build import build_library, cache_root
from .codegen.lower import lower
from .codegen.render import render_sources
from .codegen.target import get_target
from .frontends import ONNX_PIPELINE, ModelSource, import_model, model_source
from .frontends.peft import LoraAdapter, load_adapter
from .ir import Graph, print_graph
from .options import CompileOptions
from .passes.act_precision import act_precision_of
from .passes.kv_cache import kv_summary
from .passes.manager import PassContext, PassManager, PassRecord, Phase, format_pipeline
from .passes.pipeline import build_pipeline
from .passes.quantize import QuantReport, quant_layout
from .quant.formats import get_format, is_quantized
from .reuse import (artifact_cache_root, copy_built, find_built, inputs_key, model_dir_files, record_built,
                    written_files)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


@dataclass
class CompileSummary:
    out_dir: Path
    target: str
    pipeline: str
    weights_bytes: int
    kernels: int
    cache_hit: bool
    stages: dict[str, float] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)
    quant: QuantReport | None = None
    kv_bytes_per_token: float = 0.0
    kv_centred: bool = False

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())


@dataclass
class PassedGraph:
    """A model imported and run through its compile pipeline (everything before lowering)."""

    graph: Graph
    source: ModelSource
    adapters: dict[str, LoraAdapter]
    pipeline: list[tuple[str, list[str]]]
    phases: list[Phase]
    manager: PassManager
    context: PassContext                    # what the passes read and reported (quant_report, ...)


def run_pipeline(model: str | Path, options: CompileOptions, after: Callable[[str, Graph], None] | None = None,
                 timed: Callable[[str, Callable], Any] = lambda name, fn: fn(),
                 after_phase: Callable[[str, Graph], None] | None = None,
                 stage: Callable[[str], None] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> PassedGraph:
    """Import ``model`` and run the compile pipeline ``options`` describe; ``after(name, graph)`` sees
    the graph after the import (and each ONNX raising pass) and after every compile pass,
    ``after_phase(name, graph)`` after every compile phase; ``stage(description)`` hears each pass
    start (and the steps of a long one), ``progress(done, total)`` its progress."""
    source = model_source(model, options.tokenizer)
    graph = timed("import", lambda: import_model(model, options.tokenizer, strict=True, after=after))
    timed("check", lambda: check_finite(graph))
    adapters = timed("adapters", lambda: {name: load_adapter(path, graph, name) for name, path in options.lora.items()})
    phases = build_pipeline(options, adapters, graph)
    manager = PassManager.from_phases(phases, dump_dir=options.dump_ir)
    context = PassContext(adapters=adapters, model_dir=source.tokenizer_dir, search_cache=search_cache_root(),
                          progress=progress, stage=stage)
    timed("passes", lambda: manager.run(graph, context, after=after, after_phase=after_phase,
                                        before=(lambda name: stage(f"pass {name}")) if stage else None))
    return PassedGraph(graph, source, adapters, manager.pipeline, phases, manager, context)


@contextlib.contextmanager
def _artifact_lock(out_dir: Path) -> Iterator[None]:
    """The lock two compiles to one ``-o`` take turns under (``.infeng.lock`` in its folder)."""
    with open(out_dir.parent / ".infeng.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by ``staging`` atomically: under a lock in its folder (``.infeng.lock``:
    two compiles to one ``-o`` take turns, the last one's artifact stays), the old directory is
    renamed away first."""
    with _artifact_lock(out_dir):
        old = None
        if out_dir.is_symlink() or out_dir.is_file():
            raise InfengError(f"{out_dir}: exists and is not an artifact directory; give another -o")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old)            # onto the empty directory just made: a name no one else has
        os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def input_files(source: ModelSource, options: CompileOptions) -> list[Path]:
    """Every file a build reads: the model's, the adapters', the calibration text, the policy."""
    adapters = [f for d in options.lora.values() for f in sorted(Path(d).glob("adapter_*")) if f.is_file()]
    return list(source.files) + adapters + [p for p in (options.calib, options.quant_policy) if p is not None]


def options_record(options: CompileOptions, target: str) -> dict[str, Any]:
    """``options`` as JSON, paths absolute, the target resolved (``native`` names a CPU): what
    ``replay_options`` reads back."""
    record: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == "dump_ir":
            continue
        if isinstance(value, Path):
            value = str(value.resolve())
        elif f.name == "lora":
            value = {name: str(Path(path).resolve()) for name, path in value.items()}
        record[f.name] = value
    record["target"] = target
    return record


def replay_options(artifact: str | Path) -> tuple[Path, CompileOptions]:
    """(model, options) that built ``artifact``, after checking that every input file still has the
    sha256 the manifest records (``infeng compile --replay``)."""
    manifest = read_manifest(artifact)
    record = manifest.get("compile")
    if not isinstance(record, dict):
        raise InfengError(f"{artifact}: its manifest has no compile record (built by an older infeng); "
                          f"it cannot be replayed")
    for path, digest in record["inputs"].items():
        if not Path(path).is_file():
            raise InfengError(f"{path}: an input of {artifact} is gone; it cannot be replayed")
        if file_sha256(Path(path)) != digest:
            raise InfengError(f"{path}: changed since {artifact} was built (sha256 differs); it cannot be replayed")
    values = dict(record["options"])
    values.setdefault("calib_tokens", 0)    # built before the budget existed: it calibrated on every chunk
    for name in ("tokenizer", "quant_policy", "calib"):
        if values.get(name) is not None:
            values[name] = Path(values[name])
    values["lora"] = {name: Path(path) for name, path in values.get("lora", {}).items()}
    return Path(record["model"]), CompileOptions(**values)


def check_finite(graph: Graph) -> None:
    """Refuse NaN or Inf in any weight (a model that would compute garbage), naming the tensor."""
    for name, weight in graph.weights.items():
        finite = (get_format(weight.format).all_finite(weight.quantized()) if is_quantized(weight.format)
                  else _all_finite_stored(weight))
        if not finite:
            raise ModelFormatError(f"{graph.meta.get('model_dir', graph.name)}: tensor {name} has non-finite values "
                                   f"(NaN or Inf)")


def _all_finite_stored(weight) -> bool:
    """No NaN or Inf among ``weight``'s stored elements, read as stored (bf16 by its exponent bits:
    no float32 copy of a large checkpoint)."""
    if weight.format == "bf16" and weight.type.dtype == "bf16":
        return not np.any((np.asarray(weight.raw()).view(np.uint16) & 0x7F80) == 0x7F80)
    return bool(np.isfinite(weight.numpy_f32()).all())


def _reuse_built(built: Path, out_dir: Path, key: str) -> CompileSummary | None:
    """``out_dir`` as a copy of the artifact ``built`` (nothing written when it is ``out_dir``), and
    the summary its manifest gives; None when it could not be copied (then compile afresh)."""
    if built != out_dir.resolve():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        if not copy_built(built, staging):
            shutil.rmtree(staging, ignore_errors=True)
            return None
        manifest = read_manifest(staging)       # before the swap: a concurrent compile to ``out_dir`` may replace it
        files = written_files(staging)
        _swap_into_place(staging, out_dir)
        record_built(key, out_dir, files)
    else:
        with _artifact_lock(out_dir):
            manifest = read_manifest(out_dir)
    kv = manifest["kv"]
    quant = QuantReport.from_dict(manifest["quant"]) if "quant" in manifest else None
    return CompileSummary(out_dir, manifest["target"], manifest["pipeline"], manifest["weights_bytes"],
                          len(manifest["kernels"]), True, {}, [], quant, kv["bytes_per_token"],
                          bool(kv.get("k_centred")))


def compile_model(model: str | Path, out_dir: str | Path, options: CompileOptions,
                  stage: Callable[[str], None] = lambda name: None,
                  progress: Callable[[int, int], None] | None = None, reuse: bool = True) -> CompileSummary:
    """Compile ``model`` into the artifact directory ``out_dir`` (replaced atomically). With ``reuse``
    (and no ``dump_ir``), an artifact built before from the same inputs, options and compiler and
    unchanged since (``reuse.py``) is copied instead (left as it is when it is ``out_dir``)."""
    out_dir = Path(out_dir)
    if out_dir.is_file() or out_dir.is_symlink():
        raise InfengError(f"{out_dir}: exists and is not an artifact directory; give another -o")
    target = get_target(options.target)
    stages: dict[str, float] = {}
    key = None
    if reuse and options.dump_ir is None:
        start = time.perf_counter()
        stage("reuse")
        key = compile_key(model, options, target.name)
        built = find_built(key)
        if built is not None and (reused := _reuse_built(built, out_dir, key)) is not None:
            reused.stages["reuse"] = time.perf_counter() - start
            return reused
        stages["key"] = time.perf_counter() - start

    def timed(name: str, fn: Callable):
        stage(name)
        t0 = time.perf_counter()
        result = fn()
        stages[name] = time.perf_counter() - t0
        return result

    passed = run_pipeline(model, options, timed=timed, stage=stage, progress=progress)
    graph, source, adapters, pipeline, manager = (passed.graph, passed.source, passed.adapters, passed.pipeline,
                                                  passed.manager)
    model_dir = source.tokenizer_dir
    quant = passed.context.quant_report
    lowered = timed("lower", lambda: lower(graph, target, max_tokens=options.max_tokens,
                                           block_size=options.block_size))
    sources, baseline = timed("render", lambda: render_sources(lowered, options.profile))
    build = timed("build", lambda: build_library(sources, target, baseline_sources=baseline, progress=progress))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        timed("weights", lambda: write_weights(staging / WEIGHTS, graph, lowered.weights, lowered.weights_bytes,
                                               progress))
        shutil.copy2(build.path, staging / LIBRARY)
        (staging / "src").mkdir()
        for name, text in sources.items():
            (staging / "src" / name).write_text(text)
        (staging / "ir.txt").write_text(print_graph(graph))
        bundled = [name for name in adapters if name not in options.merge]
        for name in bundled:          # loaded into slots when the artifact is loaded
            dest = staging / "adapters" / name
            dest.mkdir(parents=True)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(adapters[name].path / f, dest / f)
        for name in TOKENIZER_FILES:
            if model_dir is not None and (model_dir / name).is_file():
                shutil.copy2(model_dir / name, staging / name)
        inputs = {str(p.resolve()): file_sha256(p) for p in input_files(source, options)}
        manifest = {
            "infeng_version": __version__,
            "name": graph.name,
            "source": {"model_dir": str(source.path.resolve()),
                       "sha256": {p.name: inputs[str(p.resolve())] for p in source.files},
                       **({"import_pipeline": ONNX_PIPELINE} if source.kind == "onnx" else {})},
            "config": source.config,
            "meta": graph.meta,
            "target": target.name,
            "pipeline": format_pipeline(pipeline),
            "dtype": options.dtype or "f32",
            "constants": lowered.constants,
            "kv": kv_summary(graph, lowered.constants["kv_layers"], options.block_size),
            "weights_bytes": lowered.weights_bytes,
            "tensors": [{"name": s.name, "format": s.format, "shape": list(s.shape), "offset": s.offset,
                         "nbytes": s.nbytes, **quant_layout(graph.weights[s.name])} for s in lowered.weights],
            **({"quant": quant.as_dict()} if quant else {}),
            **({"act_precision": act} if (act := act_precision_of(graph)) else {}),
            "kernels": [s.symbol for s in lowered.specs],
            "profile": [vars(e) for e in lowered.profile] if options.profile else [],
            "adapters": {"merged": list(options.merge), "bundled": bundled},
            "build": {"key": build.path.parent.name, "cache_hit": build.cache_hit},
            "files": {name: {"bytes": (staging / name).stat().st_size, "sha256": file_sha256(staging / name)}
                      for name in (LIBRARY, WEIGHTS)},
            "compile": {"model": str(source.path.resolve()), "options": options_record(options, target.name),
                        "inputs": inputs,
                        "phases": [*([{"name": "import", "passes": ONNX_PIPELINE.split(",")}]
                                     if source.kind == "onnx" else []),
                                   *(p.as_dict() for p in passed.phases)],
                        "passes": [{"name": r.name, "args": r.args, "phase": r.phase, "tolerance": r.tolerance,
                                    "changed": r.changed, "seconds": round(r.seconds, 4)} for r in manager.records]},
        }
        write_manifest(staging, manifest)
        files = written_files(staging)
        _swap_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if key is not None:
        record_built(key, out_dir, files)
    return CompileSummary(out_dir, target.name, format_pipeline(pipeline), lowered.weights_bytes,
                          len(lowered.specs), build.cache_hit, stages, manager.records, quant,
                          manifest["kv"]["bytes_per_token"], bool(manifest["kv"].get("k_centred")))


def search_cache_root() -> Path:
    """Where the quantize pass keeps its search results (``quant/search_cache.py``): beside the
    build cache."""
    return cache_root().parent / "search"


def compile_key(model: str | Path, options: CompileOptions, target: str) -> str:
    """The key of compiling ``model`` with ``options`` for ``target`` (``reuse.inputs_key``)."""
    path = Path(model)
    if path.is_file():                          # a .gguf/.onnx/.safetensors file: no need to open it
        if path.suffix == ".onnx":              # its external data, whatever their names
            beside = sorted(f for f in path.parent.iterdir() if f.is_file() and not f.name.startswith("."))
        else:                                   # a .safetensors file's config and tokenizer
            beside = model_dir_files(path.parent) if path.suffix == ".safetensors" else []
        model_files = [path] + [f for f in beside if f != path]
    elif path.is_dir():
        model_files = model_dir_files(path)
    else:                                       # a hub id: resolved (from the local cache when it is there)
        source = model_source(model, options.tokenizer)
        model_files = list(source.files) + ([] if source.tokenizer_dir is None
                                            else model_dir_files(source.tokenizer_dir))
    return inputs_key(model_files, options, target)


def cached_artifact(model: str | Path, options: CompileOptions, stage: Callable[[str], None] = lambda name: None,
                    progress: Callable[[int, int], None] | None = None) -> tuple[Path, bool]:
    """``model`` compiled with ``options``, from the artifact cache (compiled into it on a miss):
    (artifact directory, cache hit). The key is ``compile_key``'s; a hit is an artifact whose
    manifest still reads."""
    key = compile_key(model, options, get_target(options.target).name)
    out = artifact_cache_root() / f"{Path(model).stem or 'model'}-{key}.infeng"
    if is_artifact(out):
        try:
            read_manifest(out)
            return out, True
        except InfengError:                    # damaged: compile it again
            pass
    compile_model(model, out, options, stage, progress)
    return out, False

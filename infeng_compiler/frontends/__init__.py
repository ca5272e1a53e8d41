"""Frontends: a model on disk -> IR graph. ``import_model`` picks one by the path.

- a directory with ``config.json`` or a ``.safetensors`` file: ``hf.import_hf``
- a ``.onnx`` file: ``onnx.load_onnx`` and the ONNX pipeline (``ONNX_PIPELINE``), which folds the
  shape arithmetic and raises the primitive ops to transformer ops. An ONNX file carries no
  tokenizer: ``tokenizer_dir`` (a Hugging Face model or tokenizer directory) supplies it, and its
  ``config.json`` (when present) the BOS/EOS ids and the context length.
- a ``.gguf`` file (llama.cpp): ``gguf.import_gguf``, the same graph as ``hf.py`` builds; its
  tokenizer is generated from the file's metadata (``gguf.gguf_tokenizer_dir``).
- a Hugging Face Hub id (``org/name[@revision]``, not an existing path): ``hub.resolve_model_path``
  gives its snapshot in the local Hub cache (downloaded when missing), then as above.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infeng_common.errors import ModelFormatError, UnsupportedError, not_a_file

from ..ir import Graph

#: The passes that turn an imported ONNX graph into the transformer graph hf.py builds.
ONNX_PIPELINE = "fold-shapes,raise"


@dataclass
class ModelSource:
    """What the compiler needs besides the graph: where the tokenizer is, the config, the source files."""

    path: Path
    kind: str                                  # "hf", "onnx" or "gguf"
    tokenizer_dir: Path | None
    config: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


def is_onnx(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".onnx"


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def model_source(path: str | Path, tokenizer_dir: str | Path | None = None) -> ModelSource:
    from .hf import load_config, resolve_model_dir
    from .hub import resolve_model_path

    p = resolve_model_path(path)
    if is_gguf(p):
        from .gguf import gguf_source

        return gguf_source(p, tokenizer_dir)
    if is_onnx(p):
        if not p.is_file():
            raise ModelFormatError(not_a_file(p))
        tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
        if tok is not None and not tok.is_dir():
            raise ModelFormatError(f"{tok}: tokenizer directory not found")
        config = load_config(tok) if tok is not None and (tok / "config.json").is_file() else {}
        return ModelSource(p, "onnx", tok, config, [p] + _external_data_files(p))
    model_dir = resolve_model_dir(p)
    files = sorted(f for f in model_dir.iterdir() if f.suffix in (".json", ".safetensors") and f.is_file())
    return ModelSource(model_dir, "hf", Path(tokenizer_dir) if tokenizer_dir else model_dir, load_config(model_dir),
                       files)


def import_model(path: str | Path, tokenizer_dir: str | Path | None = None, *, strict: bool = False,
                 after: Callable[[str, Graph], None] | None = None) -> Graph:
    """The IR graph of a Hugging Face checkpoint or an ONNX file (raised).

    ``strict``: fail when primitive ops are left after raising (what compiling needs); ``after`` is
    called with each ONNX pass's name and the graph (``infeng ir --after``), first with "import".
    """
    from .hub import hub_model_name, resolve_model_path

    hub_name, path = hub_model_name(path), resolve_model_path(path)
    source = model_source(path, tokenizer_dir)
    if source.kind == "gguf":
        from .gguf import import_gguf

        graph = import_gguf(source.path, tokenizer_dir)
        if after:
            after("import", graph)
        return graph
    if source.kind == "hf":
        from .hf import import_hf

        graph = import_hf(path)
        if hub_name:              # not the snapshot directory's name (a commit hash)
            graph.name = hub_name
        if after:
            after("import", graph)
        return graph
    from ..passes.manager import PassManager, parse_pipeline
    from .onnx import load_onnx

    graph = load_onnx(source.path)
    if after:
        after("import", graph)
    PassManager(parse_pipeline(ONNX_PIPELINE)).run(graph, after=after)
    _onnx_meta(graph, source)
    if strict:
        require_raised(graph, source.path)
    return graph


def require_raised(graph: Graph, where: Any) -> None:
    from ..ir.ops import PRIMITIVE_OPS

    left: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.op in PRIMITIVE_OPS:
            left.setdefault(n.op, []).append(n.outputs[0].name)
    if left:
        listed = ", ".join(f"{op} x{len(v)} (first %{v[0]})" for op, v in sorted(left.items()))
        raise UnsupportedError(f"{where}: {sum(map(len, left.values()))} primitive ONNX op(s) were not raised to "
                               f"transformer ops and have no kernels: {listed}. "
                               f"`infeng ir {where} --after raise` shows the graph")


def _onnx_meta(graph: Graph, source: ModelSource) -> None:
    c = source.config
    eos = c.get("eos_token_id")
    pos_table = next((n.weights[0].type.shape[0] for n in graph.nodes
                      if n.op == "embedding" and n.inputs[0].name == "positions"), None)
    graph.meta.update({
        "model_dir": str(source.tokenizer_dir.resolve()) if source.tokenizer_dir else None,
        "bos_token_id": c.get("bos_token_id"),
        "eos_token_ids": eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        "max_position_embeddings": pos_table or c.get("max_position_embeddings") or c.get("n_positions") or 2048,
    })


def _external_data_files(path: Path) -> list[Path]:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # reported by the importer with context
        return []
    names = {e.value for t in model.graph.initializer if t.data_location == 1 for e in t.external_data
             if e.key == "location"}
    return [path.parent / n for n in sorted(names) if (path.parent / n).is_file()]


__all__ = ["import_model", "model_source", "ModelSource", "is_onnx", "is_gguf", "ONNX_PIPELINE", "require_raised"]

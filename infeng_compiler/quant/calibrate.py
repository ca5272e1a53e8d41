"""Calibration: run the float32 model (the reference interpreter) over text and collect, for every
value that feeds a ``linear``/``logits``, per-channel activation statistics.

For a value ``x`` [tokens, K] the statistics are the token count, the mean |x| per channel (what
the AWQ scale search raises to a power) and the Gram matrix ``XᵀX`` [K, K] (float64), with which
the output error of any weight change ``D`` is ``tr(D XᵀX Dᵀ)`` without keeping the activations.

``collect`` runs every chunk as a whole sequence from position 0, so its attention is one causal
float32 product per sequence with a fixed mask and an in-place softmax (``causal_attention``)
instead of the reference's float64 path through the KV cache (70% of the time on stories260K);
the Gram matrix of each step is a float32 product added to the float64 sum. Both differ from the
reference by rounding only (docs/performance.md, *Calibration's forward in float32*, has the
quality table).

``value_means`` is the lighter statistic the KV cache passes need: the mean row of chosen values
(the k rows of every attention layer, for K centring).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infeng_common.errors import InfengError

from ..interp import Interpreter, KVStore, NodeObserver, Step
from ..ir import Graph, Node
from ..ir.ops import Reference
from ..ir.ops import get as get_op

#: ops whose first input is multiplied by their first weight (the tensors a search can weigh)
MATMUL_OPS = ("linear", "lora_linear", "logits")


@dataclass
class ActStats:
    """Statistics of one activation value over the calibration tokens."""

    tokens: int
    abs_mean: np.ndarray         # [K] mean |x| per channel
    gram: np.ndarray             # [K, K] float64, sum over tokens of x xᵀ

    def scaled(self, s: np.ndarray) -> ActStats:
        """The statistics of ``x / s`` (after a per-channel scale folded into the producer)."""
        inv = 1.0 / np.asarray(s, dtype=np.float64)
        return ActStats(self.tokens, self.abs_mean * inv, self.gram * inv[:, None] * inv[None, :])


def calibration_args(calib: str | Path, calib_max_bytes: int | None) -> list[str]:
    """The ``calib=``/``calib_max_bytes=`` pipeline arguments for ``--calib``/``--calib-max-bytes``,
    checked now (the file exists, the byte count is positive)."""
    if not Path(calib).is_file():
        raise InfengError(f"{calib}: calibration text file not found")
    args = [f"calib={Path(calib).resolve()}"]
    if calib_max_bytes is not None:
        if calib_max_bytes <= 0:
            raise InfengError(f"--calib-max-bytes must be positive, got {calib_max_bytes}")
        args.append(f"calib_max_bytes={calib_max_bytes}")
    return args


def calibration_ids(tokenizer, path: str | Path, max_bytes: int | None, ctx: int,
                    max_tokens: int | None = None) -> np.ndarray:
    """The calibration text as [chunks, ctx] token ids, BOS first in every chunk; with ``max_tokens``
    (a budget; None or 0: all), only the chunks ``spread_chunks`` keeps."""
    from ..evaluate import chunk_tokens, read_text

    ids = tokenizer.encode(read_text(path, max_bytes), add_bos=True)
    if len(ids) < ctx:
        raise InfengError(f"{path}: the calibration text has {len(ids)} tokens, fewer than one chunk of {ctx}; "
                          "give more text (or a larger --calib-max-bytes)")
    return spread_chunks(chunk_tokens(ids, ctx, tokenizer.bos_token_id), max_tokens)


def spread_chunks(chunks: np.ndarray, max_tokens: int | None) -> np.ndarray:
    """At most ``max_tokens`` tokens of ``chunks`` [n, ctx] (None or 0: all of them): whole chunks, at
    least one, spread evenly over the text (chunk ``i * n // keep`` for ``i < keep``, the first
    included), in the text's order. A budget reads the whole text's variety, not its beginning."""
    n, ctx = chunks.shape
    keep = max(1, max_tokens // ctx) if max_tokens else n
    if keep >= n:
        return chunks
    return chunks[np.arange(keep) * n // keep]


def collect(graph: Graph, chunks: np.ndarray, batch: int = 8,
            progress: Callable[[int, int], None] | None = None) -> dict[str, ActStats]:
    """Run ``graph`` (float32) over ``chunks`` [n, ctx]; statistics of every matmul input value.
    The ``logits`` node is not run: its input is counted, its result is not needed."""
    watched = {n.inputs[0].name for n in graph.nodes if n.op in MATMUL_OPS}
    sums: dict[str, list] = {}

    def observe(node: Node, inputs: list[np.ndarray], weights: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for value, array in zip(node.outputs, outputs):
            if value.name in watched:
                _accumulate(sums, value.name, array)

    _run_chunks(graph, [n for n in graph.nodes if n.op != "logits"], chunks, batch, observe, progress,
                {"attention": causal_attention(chunks.shape[1])})
    return {name: ActStats(cnt, absum / cnt, gram) for name, (cnt, absum, gram) in sums.items()}


def _accumulate(sums: dict[str, list], name: str, x: np.ndarray) -> None:
    """Add one step's rows of ``x`` to the sums of ``name``: a float32 Gram product per step (its
    rows are one step's tokens, thousands), the running sums in float64."""
    x32 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    entry = sums.setdefault(name, [0, np.zeros(x32.shape[1]), np.zeros((x32.shape[1], x32.shape[1]))])
    entry[0] += x32.shape[0]
    entry[1] += np.abs(x32).sum(axis=0, dtype=np.float64)
    entry[2] += x32.T @ x32


#: attributes of ``attention`` that ``causal_attention`` computes; any other goes to the reference
_PLAIN_ATTENTION = {"layer", "n_heads", "n_kv_heads", "head_dim", "scale", "window"}


def causal_attention(ctx: int) -> Reference:
    """``attention`` for steps whose tokens are whole sequences of ``ctx`` tokens from position 0
    (``_run_chunks``): per sequence, the scores of all heads are one float32 product masked by one
    causal (and window) mask, the softmax is float32 and in place. The reference's result up to
    rounding (it works in float64 through the KV cache, which no later step of calibration reads).
    Attention with a KV format, ``k_mean`` or sinks goes to the reference. The products stay one
    sequence's size ([heads, ctx, head_dim] x [heads, head_dim, ctx]): larger batched products
    make OpenBLAS start its threads for every one, many times slower on a busy machine."""
    reference = get_op("attention").reference
    j = np.arange(ctx)

    def attend(ins: list[np.ndarray], ws: list[np.ndarray], attrs: dict, step: Step) -> list[np.ndarray]:
        if ws or not _PLAIN_ATTENTION.issuperset(attrs):
            return reference(ins, ws, attrs, step)
        q, k, v, _ = ins
        h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
        per_kv = h // kvh
        allowed = j[None, :] <= j[:, None]
        if attrs.get("window"):
            allowed &= j[None, :] > j[:, None] - attrs["window"]
        mask = np.where(allowed, np.float32(0.0), np.float32(-np.inf))               # [ctx, ctx]
        queries = (q * np.float32(attrs["scale"])).reshape(-1, ctx, h, hd)
        keys, values = (np.repeat(x.reshape(-1, ctx, kvh, hd), per_kv, axis=2) for x in (k, v))  # [n, ctx, h, hd]
        out = np.empty_like(queries)
        for s in range(len(queries)):
            scores = np.ascontiguousarray(queries[s].transpose(1, 0, 2)) @ np.ascontiguousarray(
                keys[s].transpose(1, 2, 0))                                               # [h, ctx, ctx]
            scores += mask
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            rows = scores @ np.ascontiguousarray(values[s].transpose(1, 0, 2))           # [h, ctx, hd]
            out[s] = (rows / scores.sum(axis=-1, keepdims=True)).transpose(1, 0, 2)
        return [out.reshape(-1, h * hd)]

    return attend


def value_means(graph: Graph, chunks: np.ndarray, names: set[str], batch: int = 8,
                progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Run ``graph`` (float32) over ``chunks`` [n, ctx]: the mean row (float64 [width]) of every value
    in ``names`` over all calibration tokens. Nodes after the last producer of a watched value are
    not run."""
    producers = [i for i, n in enumerate(graph.nodes) if any(o.name in names for o in n.outputs)]
    missing = names - {o.name for n in graph.nodes for o in n.outputs}
    if missing:
        raise InfengError(f"calibration: no node produces {', '.join(sorted(missing))}")
    sums: dict[str, np.ndarray] = {}

    def observe(node: Node, inputs: list[np.ndarray], weights: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for value, array in zip(node.outputs, outputs):
            if value.name in names:
                rows = np.asarray(array, dtype=np.float64).reshape(-1, array.shape[-1])
                sums[value.name] = sums.get(value.name, 0.0) + rows.sum(axis=0)

    _run_chunks(graph, graph.nodes[: max(producers) + 1], chunks, batch, observe, progress)
    return {name: total / chunks.size for name, total in sums.items()}


def _run_chunks(graph: Graph, nodes: list[Node], chunks: np.ndarray, batch: int, observer: NodeObserver,
                progress: Callable[[int, int], None] | None,
                references: dict[str, Reference] | None = None) -> None:
    """Run ``nodes`` of ``graph`` with the interpreter over ``chunks`` [n, ctx], ``batch`` chunks (one
    sequence each, from position 0, a fresh KV cache) per step; ``observer`` sees every node;
    ``references`` replace the registry's for their ops."""
    interpreter = Interpreter(graph, observer, references)
    n, ctx = chunks.shape
    for start in range(0, n, batch):
        group = chunks[start:start + batch]
        b = len(group)
        tokens = group.reshape(-1).astype(np.int32)
        step = Step(np.repeat(np.arange(b, dtype=np.int32), ctx), np.arange(len(tokens)), KVStore())
        env: dict[str, np.ndarray] = {"tokens": tokens, "positions": np.tile(np.arange(ctx, dtype=np.int32), b),
                                      "adapter_slots": np.full(len(tokens), -1, np.int32)}
        interpreter.run(env, step, nodes)
        if progress:
            progress(min(start + batch, n), n)

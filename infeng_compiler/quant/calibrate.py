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

``collect`` runs the graph one segment at a time: the nodes between two points where a single
value (the residual stream) is all that later nodes read of earlier ones. Every chunk goes through a
segment before the next segment starts, the values crossing into it kept for all chunks
(tokens x hidden float32), so only one segment's float32 weights and Gram sums are held at once.
The steps, their rows and the order of every sum are those of one pass through the whole graph, so
the statistics are the same bits. ``collect(finish=...)`` hands each value's statistics over as soon
as its segment is done and keeps what ``finish`` returns instead: the quantize pass searches AWQ on
the full Gram there and keeps only its group blocks (``ActStats.reduced``), which is all the
clipping search reads.

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
    """Statistics of one activation value over the calibration tokens: the full Gram matrix, or
    (``reduced``) only what the clipping search reads of it."""

    tokens: int
    abs_mean: np.ndarray         # [K] mean |x| per channel
    gram: np.ndarray | None      # [K, K] float64, sum over tokens of x xᵀ (None once reduced)
    #: the reduced Gram: group size G -> its diagonal blocks [ceil(K/G), G, G] (zero-padded past K),
    #: 0 -> its diagonal [K]
    blocks: dict[int, np.ndarray] | None = None

    def scaled(self, s: np.ndarray) -> ActStats:
        """The statistics of ``x / s`` (after a per-channel scale folded into the producer); the
        reduced Gram's entries are scaled as the full one's would be, the same bits."""
        inv = 1.0 / np.asarray(s, dtype=np.float64)
        gram = None if self.gram is None else self.gram * inv[:, None] * inv[None, :]
        blocks = None
        if self.blocks is not None:
            blocks = {}
            for group, b in self.blocks.items():
                if group == 0:
                    blocks[0] = b * inv * inv
                else:
                    padded = np.ones(b.shape[0] * group)
                    padded[:len(inv)] = inv
                    rows = padded.reshape(-1, group)
                    blocks[group] = b * rows[:, :, None] * rows[:, None, :]
        return ActStats(self.tokens, self.abs_mean * inv, gram, blocks)

    def reduced(self, groups: set[int]) -> ActStats:
        """Only the Gram's diagonal blocks of each group size in ``groups`` (0: its diagonal)."""
        if self.gram is None:
            return self
        K = self.gram.shape[0]
        blocks = {}
        for group in sorted(groups):
            if group == 0:
                blocks[0] = np.diag(self.gram).copy()
                continue
            ng = -(-K // group)
            full = self.gram
            if ng * group != K:
                full = np.zeros((ng * group, ng * group))
                full[:K, :K] = self.gram
            idx = np.arange(ng)
            blocks[group] = full.reshape(ng, group, ng, group)[idx, :, idx, :]
        return ActStats(self.tokens, self.abs_mean, None, blocks)

    def error_weights(self, group: int) -> np.ndarray:
        """What the clipping search of a format with ``group`` (0: per row) weighs errors by: the
        Gram / tokens, full or reduced."""
        tokens = max(self.tokens, 1)
        if self.gram is not None:
            return self.gram / tokens
        return self.blocks[group] / tokens


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
            progress: Callable[[int, int], None] | None = None,
            finish: Callable[[str, ActStats], ActStats] | None = None) -> dict[str, ActStats]:
    """Run ``graph`` (float32) over ``chunks`` [n, ctx]; statistics of every matmul input value.
    The ``logits`` node is not run: its input is counted, its result is not needed. ``finish(name,
    stats)``: called once per value when its statistics are complete (in the graph's order); what
    it returns is kept instead of them. ``progress(done, total)`` counts segments x steps."""
    watched = {n.inputs[0].name for n in graph.nodes if n.op in MATMUL_OPS}
    segments = _segments(graph, [n for n in graph.nodes if n.op != "logits"])
    references = {"attention": causal_attention(chunks.shape[1])}
    n, ctx = chunks.shape
    steps = range(0, n, batch)
    carried: list[dict[str, np.ndarray]] = [{} for _ in steps]
    stats: dict[str, ActStats] = {}
    for index, (nodes, carry) in enumerate(segments):
        sums: dict[str, list] = {}

        def observe(node: Node, inputs: list[np.ndarray], weights: list[np.ndarray], outputs: list[np.ndarray]) -> None:
            for value, array in zip(node.outputs, outputs):
                if value.name in watched:
                    _accumulate(sums, value.name, array)

        interpreter = Interpreter(graph, observe, references)          # this segment's weights only
        for i, start in enumerate(steps):
            env = _step_env(chunks[start:start + batch]) | carried[i]
            interpreter.run(env, _step(len(chunks[start:start + batch]), ctx), nodes)
            carried[i] = {name: env[name] for name in carry}
            if progress:
                progress(index * len(steps) + i + 1, len(segments) * len(steps))
        del interpreter
        for node in nodes:
            for value in node.outputs:
                if value.name in sums:
                    cnt, absum, gram = sums.pop(value.name)
                    st = ActStats(cnt, absum / cnt, gram)
                    stats[value.name] = finish(value.name, st) if finish else st
    return stats


def _segments(graph: Graph, nodes: list[Node]) -> list[tuple[list[Node], list[str]]]:
    """``nodes`` cut wherever later nodes read at most one value of earlier ones (besides the
    graph's inputs): [(a segment's nodes, the values it hands to later segments)]."""
    inputs = {v.name for v in graph.inputs}
    last_use: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            last_use[v.name] = i
    live: set[str] = set()
    segments: list[tuple[list[Node], list[str]]] = []
    start = 0
    for i, node in enumerate(nodes):
        live = {name for name in live if last_use.get(name, -1) > i}
        live |= {v.name for v in node.outputs if last_use.get(v.name, -1) > i and v.name not in inputs}
        if len(live) <= 1 and i + 1 < len(nodes):
            segments.append((nodes[start:i + 1], sorted(live)))
            start = i + 1
    segments.append((nodes[start:], []))
    return segments


def _step_env(group: np.ndarray) -> dict[str, np.ndarray]:
    """The graph inputs of one calibration step: ``group`` [b, ctx] chunks, each from position 0."""
    b, ctx = group.shape
    return {"tokens": group.reshape(-1).astype(np.int32), "positions": np.tile(np.arange(ctx, dtype=np.int32), b),
            "adapter_slots": np.full(b * ctx, -1, np.int32)}


def _step(b: int, ctx: int) -> Step:
    """One calibration step of ``b`` sequences of ``ctx`` tokens, a fresh KV cache."""
    return Step(np.repeat(np.arange(b, dtype=np.int32), ctx), np.arange(b * ctx), KVStore())


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
        interpreter.run(_step_env(group), _step(len(group), ctx), nodes)
        if progress:
            progress(min(start + batch, n), n)

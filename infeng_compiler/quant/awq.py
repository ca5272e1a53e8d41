"""Activation-aware per-channel scaling (AWQ, Lin et al. 2023), folded into the producing op.

For a value ``x`` that only feeds ``linear`` nodes, multiplying the weights' input channels by
``s`` and dividing ``x`` by ``s`` changes nothing in exact arithmetic, but it changes what
quantization loses: channels with large activations get finer steps. ``x / s`` is folded into the
op that produces ``x``, so no op is added:

| producer of x | where 1/s goes |
| --- | --- |
| ``rms_norm`` | its weight (γ / s) |
| ``layer_norm`` | its weight and bias |
| ``silu_mul(gate, up)`` | the rows (and bias) of the ``linear`` producing ``up`` |
| ``attention(q, k, v)`` | the rows (and bias) of the ``linear`` producing ``v``; with grouped KV heads every query head of a group shares its KV head's scale |

``s = mean|x|^α`` normalised to geometric mean 1 (``sqrt(max·min)``), with α on a grid; the α whose
round-to-nearest quantization of every consumer gives the least output error
``Σ tr(D XᵀX Dᵀ)``, ``D = Q(W·s)/s − W``, wins. α = 0 (no scaling) is on the grid, so the search
never does worse than no scaling on the calibration data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import Graph, Node, TensorType, Weight
from .calibrate import ActStats
from .formats import get_format
from .search import SymmetricChoice, quantize

ALPHAS = tuple(float(a) for a in np.round(np.arange(0.0, 1.0, 0.05), 2))


@dataclass
class AwqScale:
    """One folded scaling: the value, where 1/s went, the weights multiplied, α and the loss change."""

    value: str
    folded_into: str
    weights: list[str]
    alpha: float
    loss_before: float
    loss_after: float
    scale: np.ndarray


#: value name -> (α, loss before, loss after) of a search done before (``apply_awq``'s ``chosen``).
AwqChoices = dict[str, tuple[float, float, float]]


def apply_awq(graph: Graph, stats: dict[str, ActStats], formats: dict[str, str],
              alphas: tuple[float, ...] = ALPHAS, chosen: AwqChoices | None = None) -> list[AwqScale]:
    """Search and fold a scale for every value whose consumers are all quantized ``linear``
    nodes and whose producer can absorb it. Returns what was folded (α = 0 results are skipped).
    ``chosen``: the α (and losses) of every value searched before, used instead of searching;
    a value not in it is searched (its statistics need the full Gram) and added to it."""
    done: list[AwqScale] = []
    for value in [v for n in graph.nodes for v in n.outputs]:
        if value.name not in stats:
            continue
        plan = _plan(graph, value.name, formats)
        if plan is None:
            continue
        consumers, fold = plan
        st = stats[value.name]
        if chosen is not None and value.name in chosen:
            alpha, base_loss, loss = chosen[value.name]
        else:
            alpha, base_loss, loss = search_alpha(graph, value.name, st, formats, alphas)
            if chosen is not None:
                chosen[value.name] = (alpha, base_loss, loss)
        if alpha == 0.0:
            continue
        s = _scale(_channel_means(st, fold), alpha)
        s_in = _expand_kv(s, fold[1]) if fold[0] == "attention" else s
        for n in consumers:                                    # one weight's float32 copy at a time
            w = graph.weights[n.weights[0].name].numpy_f32()
            _replace(graph, n.weights[0], w * s_in[None, :].astype(np.float32))
        target = _fold(graph, fold, s)
        stats[value.name] = st.scaled(s_in)
        done.append(AwqScale(value.name, target, [n.weights[0].name for n in consumers], alpha,
                             float(base_loss), float(loss), s_in))
    return done


def awq_site(graph: Graph, value: str, formats: dict[str, str]) -> bool:
    """Whether ``apply_awq`` searches a scale for ``value`` (its consumers and producer allow one)."""
    return _plan(graph, value, formats) is not None


def search_alpha(graph: Graph, value: str, st: ActStats, formats: dict[str, str],
                 alphas: tuple[float, ...] = ALPHAS,
                 symmetric_choice: SymmetricChoice | None = None) -> tuple[float, float, float]:
    """(α, loss without scaling, loss with it) of ``value`` (an ``awq_site``) on its full-Gram
    statistics ``st``, the graph's weights as they are. ``symmetric_choice``: round-to-nearest's
    choice between int4's two scale bases in C (``quantize``'s), the same codes as numpy's."""
    consumers, fold = _plan(graph, value, formats)
    ws = [graph.weights[n.weights[0].name].numpy_f32() for n in consumers]
    return _search_alpha(_channel_means(st, fold), fold, ws, [formats[n.weights[0].name] for n in consumers],
                         st.gram / max(st.tokens, 1), alphas, symmetric_choice)


def _channel_means(st: ActStats, fold) -> np.ndarray:
    """The mean |x| the scale is a power of (per KV channel when folded into attention's v)."""
    a = np.maximum(st.abs_mean, 1e-8)
    return _per_kv_channel(a, fold[1]) if fold[0] == "attention" else a


def _scale(a: np.ndarray, alpha: float) -> np.ndarray:
    """``a^α`` normalised to geometric mean 1 (of its extremes)."""
    s = a ** alpha
    return s / np.sqrt(s.max() * s.min())


def _search_alpha(a: np.ndarray, fold: tuple, ws: list[np.ndarray], fmts: list[str], gram: np.ndarray,
                  alphas: tuple[float, ...], symmetric_choice: SymmetricChoice | None = None
                  ) -> tuple[float, float, float]:
    """(α, loss without scaling, loss with it): the α of least output error (0: none helps)."""
    base_loss = _loss(ws, fmts, np.ones(ws[0].shape[1]), gram, symmetric_choice)
    best = (base_loss, 0.0)
    for alpha in alphas:
        if alpha == 0.0:
            continue
        s = _scale(a, alpha)
        s_in = _expand_kv(s, fold[1]) if fold[0] == "attention" else s
        loss = _loss(ws, fmts, s_in, gram, symmetric_choice)
        if loss < best[0]:
            best = (loss, alpha)
    return best[1], float(base_loss), float(best[0])


def _loss(ws: list[np.ndarray], fmts: list[str], s: np.ndarray, gram: np.ndarray,
          symmetric_choice: SymmetricChoice | None = None) -> float:
    """Σ over the consumers of tr(D G Dᵀ), D = Q(W·s)/s − W: every consumer's D stacked, one
    float64 product with the Gram (BLAS), then each consumer's rows summed, consumers in order."""
    ds = []
    for w, fmt in zip(ws, fmts):
        scaled = (w * s[None, :]).astype(np.float32)
        quant = quantize(scaled, get_format(fmt), search=False, symmetric_choice=symmetric_choice)
        deq = quant.dequantize() / s[None, :]
        ds.append((deq - w).astype(np.float64))
    d = ds[0] if len(ds) == 1 else np.concatenate(ds)
    del ds
    dg = d @ gram
    total, row = 0, 0
    for w in ws:
        total += float(np.einsum("nl,nl->", dg[row:row + len(w)], d[row:row + len(w)]))
        row += len(w)
    return total


def _plan(graph: Graph, value: str, formats: dict[str, str]):
    """(consumers, fold) when ``value`` can be scaled, else None."""
    users = graph.users().get(value, [])
    if not users or any(n.op != "linear" or n.inputs[0].name != value for n in users):
        return None
    weight_uses = _weight_uses(graph)
    for n in users:
        w = n.weights[0].name
        if w not in formats or weight_uses[w] != 1:
            return None
    producer = graph.producers().get(value)
    if producer is None:
        return None
    if producer.op in ("rms_norm", "layer_norm"):
        if any(weight_uses[w.name] != 1 for w in producer.weights):
            return None
        return users, ("norm", producer)
    if producer.op == "silu_mul":
        up = _sole_linear_producer(graph, producer.inputs[1].name, producer, weight_uses)
        return (users, ("rows", up)) if up is not None else None
    if producer.op == "attention":
        v = _sole_linear_producer(graph, producer.inputs[2].name, producer, weight_uses)
        if v is None:
            return None
        return users, ("attention", (producer, v))
    return None


def _weight_uses(graph: Graph) -> dict[str, int]:
    uses: dict[str, int] = {}
    for n in graph.nodes:
        for w in n.weights:
            uses[w.name] = uses.get(w.name, 0) + 1
    return uses


def _sole_linear_producer(graph: Graph, value: str, consumer: Node, weight_uses: dict[str, int]) -> Node | None:
    """The ``linear`` producing ``value`` when ``consumer`` is its only reader and its weights are unshared."""
    p = graph.producers().get(value)
    if p is None or p.op != "linear" or graph.users().get(value, []) != [consumer]:
        return None
    if any(weight_uses[w.name] != 1 for w in p.weights):
        return None
    return p


def _per_kv_channel(a: np.ndarray, fold) -> np.ndarray:
    """Mean |x| of the attention output per KV channel (the query heads of a group averaged)."""
    attn, _ = fold
    h, kvh, hd = attn.attrs["n_heads"], attn.attrs["n_kv_heads"], attn.attrs["head_dim"]
    return a.reshape(kvh, h // kvh, hd).mean(axis=1).reshape(-1)


def _expand_kv(s: np.ndarray, fold) -> np.ndarray:
    attn, _ = fold
    h, kvh, hd = attn.attrs["n_heads"], attn.attrs["n_kv_heads"], attn.attrs["head_dim"]
    return np.repeat(s.reshape(kvh, 1, hd), h // kvh, axis=1).reshape(-1)


def _fold(graph: Graph, fold, s: np.ndarray) -> str:
    """Divide the producer's output channels by ``s``; returns the weight(s) changed."""
    kind, target = fold
    current = lambda w: graph.weights[w.name].numpy_f32()  # noqa: E731  (after earlier folds)
    if kind == "norm":
        for w in target.weights:
            _replace(graph, w, current(w) / s.astype(np.float32))
        return target.weights[0].name
    linear = target if kind == "rows" else target[1]
    w = linear.weights[0]
    _replace(graph, w, current(w) / s[:, None].astype(np.float32))
    if len(linear.weights) > 1:
        b = linear.weights[1]
        _replace(graph, b, current(b) / s.astype(np.float32))
    return w.name


def _replace(graph: Graph, old: Weight, array: np.ndarray) -> None:
    """Give weight ``old.name`` new float32 data (an inline weight of the same name and attributes)."""
    current = graph.weights[old.name]
    new = Weight(current.name, TensorType("f32", current.type.shape),
                 array=np.ascontiguousarray(array, dtype=np.float32), attrs=dict(current.attrs))
    graph.weights[current.name] = new
    for n in graph.nodes:
        n.weights = [new if w.name == current.name else w for w in n.weights]

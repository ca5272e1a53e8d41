"""Passes ``kv-format(K[,V][,window=N][,group=G][,calib=FILE])`` and ``fht-kv``: the KV cache format
of every attention layer, and the Hadamard rotation that makes it quantize well. ``--kv fht-int8``
is the pipeline ``fht-kv,kv-format(int8)``: the rotation first, then the format (and the K centring,
in the rotated space); neither pass runs the other.

``kv-format`` sets the attention attributes ``k_format``, ``v_format`` (f32, f16, int8, int4; V
defaults to K), ``kv_group`` (int4 values per scale, default min(32, head_dim)) and
``kv_window`` (the most recent N positions before each query read from an f16 copy, KIVI-style;
only meaningful for int8/int4).

With ``calib=FILE`` (and optionally ``calib_max_bytes=N``, ``calib_ctx=N``, default 256 tokens per
chunk) and an int8/int4 K, it also centres K: the float32 graph runs over the calibration text
(the interpreter), and the mean k row of every layer, after RoPE (and after the rotation, for
``fht-kv``), becomes the attention node's weight ``k_mean``, subtracted from every k row before it
is stored. Exact for attention: q·(k - mu) = q·k - q·mu moves every score of one query by the same
amount, which softmax ignores; but the quantization step of a row is now set by its spread around
the mean, not by channels whose mean is large (stories260K: fht-int8 KL divergence 0.0036 ->
0.0011, docs/kv-cache.md). Without ``calib`` nothing is centred.

``fht-kv`` rotates every head of Q, K and V by the normalised Walsh-Hadamard matrix H (symmetric,
orthogonal, H·H = I), which spreads a few outlier channels over the whole head before quantization:

- V: folded into the weights. Each head's rows of v_proj become H·W_v (and its bias H·b_v), so the
  cache holds H·v; attention output is a convex combination of cached rows, so it comes out as
  H·o; each head's columns of o_proj become W_o·H, and W_o·H·H·o = W_o·o. No work at run time.
- Q and K: RoPE sits between the projection and the cache and does not commute with H, so they are
  rotated online after RoPE (``rotate_qk``: an in-register fast Hadamard transform in the kernel);
  scores are unchanged because (H·q)·(H·k) = q·k.

In exact arithmetic both are the identity on the model's output (``tolerance`` 1e-5: float32
rounding of the rotated weights). A head_dim that is not a power of two is refused (padding it
would grow the cache by up to 2x; see docs/kv-cache.md). ``fht-kv`` takes no arguments: the
formats are ``kv-format``'s, in the entry after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import InfengError

from ..ir import Graph, Node, TensorType, Weight
from ..quant.calibrate import calibration_args
from ..quant.kv import KV_FORMATS, QUANTIZED, check_format, default_group, hadamard, is_power_of_two
from .context import PassContext

#: max |logits change| / max |logit| per KV format, measured on the tests' random models (weights of
#: std 0.2, peaky attention) with margin: f16 about 1e-3, int8 about 1e-2, int4 about 0.1.
FORMAT_TOLERANCE = {"f32": 0.0, "f16": 5e-3, "int8": 5e-2, "int4": 0.5}


@dataclass
class KVArgs:
    """The arguments of ``kv-format`` / ``fht-kv``."""

    k_format: str = "f32"
    v_format: str = "f32"
    window: int = 0
    group: int | None = None
    calib: str | None = None              # calibration text for K centring
    calib_max_bytes: int | None = None
    calib_ctx: int = 256


def parse_kv_args(pass_name: str, args: tuple[str, ...]) -> KVArgs:
    """``KVArgs`` from ``("int4", "int8", "window=64", "group=32", "calib=wiki.txt")``."""
    formats: list[str] = []
    numbers: dict[str, int] = {}
    calib = None
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            formats.append(arg)
            continue
        if key == "calib":
            calib = value
            continue
        if key not in ("window", "group", "calib_max_bytes", "calib_ctx"):
            raise InfengError(f"{pass_name}: unknown argument {key!r} (known: window, group, calib, calib_max_bytes, "
                              f"calib_ctx)")
        try:
            numbers[key] = int(value)
        except ValueError:
            raise InfengError(f"{pass_name}: {key}={value!r} is not an integer") from None
    if len(formats) > 2:
        raise InfengError(f"{pass_name}: at most two formats (K, then V), got {', '.join(formats)}")
    for fmt in formats:
        if fmt not in KV_FORMATS:
            raise InfengError(f"{pass_name}: unknown KV format {fmt!r} (known: {', '.join(KV_FORMATS)})")
    window, group = numbers.get("window", 0), numbers.get("group")
    if window < 0 or (group is not None and group < 1):
        raise InfengError(f"{pass_name}: window must be >= 0 and group >= 1")
    if numbers.get("calib_max_bytes", 1) < 1 or numbers.get("calib_ctx", 4) < 4:
        raise InfengError(f"{pass_name}: calib_max_bytes must be >= 1 and calib_ctx >= 4")
    if calib is None and ("calib_max_bytes" in numbers or "calib_ctx" in numbers):
        raise InfengError(f"{pass_name}: calib_max_bytes and calib_ctx need calib=FILE")
    k = formats[0] if formats else "f32"
    v = formats[1] if len(formats) > 1 else k
    if calib is not None and k not in QUANTIZED:
        raise InfengError(f"{pass_name}: calib=FILE centres an int8/int4 K; K is {k}, which has no step to gain")
    return KVArgs(k, v, window, group, calib, numbers.get("calib_max_bytes"), numbers.get("calib_ctx", 256))


class KVFormat:
    name = "kv-format"

    def __init__(self, *args: str):
        parsed = parse_kv_args(self.name, args)
        self.k_format, self.v_format, self.window, self.group = (parsed.k_format, parsed.v_format, parsed.window,
                                                                 parsed.group)
        self.calib, self.calib_max_bytes, self.calib_ctx = parsed.calib, parsed.calib_max_bytes, parsed.calib_ctx
        self.tolerance = max(FORMAT_TOLERANCE[self.k_format], FORMAT_TOLERANCE[self.v_format])

    def attrs_for(self, node: Node) -> dict[str, Any]:
        hd = node.attrs["head_dim"]
        attrs: dict[str, Any] = {"k_format": self.k_format, "v_format": self.v_format}
        if "int4" in (self.k_format, self.v_format):
            attrs["kv_group"] = self.group or default_group(hd)
        if self.window and (self.k_format in QUANTIZED or self.v_format in QUANTIZED):
            attrs["kv_window"] = self.window
        where = f"{self.name}: layer {node.attrs['layer']}"
        check_format(self.k_format, hd, attrs.get("kv_group"), where)
        check_format(self.v_format, hd, attrs.get("kv_group"), where)
        return attrs

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = self.centre_k(graph, ctx) if self.calib else False
        for node in graph.find("attention"):
            new = self.attrs_for(node)
            old = {k: node.attrs[k] for k in ("k_format", "v_format", "kv_group", "kv_window") if k in node.attrs}
            if old != new:
                for k in ("k_format", "v_format", "kv_group", "kv_window"):
                    node.attrs.pop(k, None)
                node.attrs.update(new)
                changed = True
        return changed

    def centre_k(self, graph: Graph, ctx: PassContext) -> bool:
        """Give every attention node the mean k row of the calibration text as its ``k_mean``
        (in the space the cache stores: after RoPE, rotated when ``rotate_qk``). Runs on the graph
        as it is before this pass sets formats (float32 caches); a node that has one keeps it."""
        from ..quant.calibrate import calibration_ids, value_means

        nodes = [n for n in graph.find("attention") if not n.weights]
        if not nodes:
            return False
        ctx_tokens = min(self.calib_ctx, int(graph.meta.get("max_position_embeddings") or self.calib_ctx))
        chunks = calibration_ids(ctx.calibration_tokenizer(graph, self.name), self.calib, self.calib_max_bytes,
                                 ctx_tokens)
        means = value_means(graph, chunks, {n.inputs[1].name for n in nodes}, progress=ctx.progress)
        for node in nodes:
            kvh, hd = node.attrs["n_kv_heads"], node.attrs["head_dim"]
            mean = means[node.inputs[1].name].reshape(kvh, hd)
            if node.attrs.get("rotate_qk"):      # the kernel subtracts it from H·k
                mean = mean @ hadamard(hd)
            name = f"{node.output.name}.k_mean"
            graph.weights.pop(name, None)
            node.weights = [graph.add_weight(Weight(name, TensorType("f32", (kvh * hd,)),
                                                    array=np.ascontiguousarray(mean.reshape(-1), dtype=np.float32)))]
        ctx.kv_calib_tokens = int(chunks.size)
        return True


class FhtKV:
    name = "fht-kv"
    tolerance = 1e-5      # relative: float32 rounding of the rotated weights

    def __init__(self, *args: str):
        if args:
            raise InfengError(f"fht-kv takes no arguments, got {','.join(args)}; give the cache formats to a "
                              f"kv-format entry after it: fht-kv,kv-format({','.join(args)})")

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = False
        for node in list(graph.find("attention")):
            if node.attrs.get("rotate_qk"):
                continue
            hd = node.attrs["head_dim"]
            if not is_power_of_two(hd):
                raise InfengError(
                    f"fht-kv: layer {node.attrs['layer']} has head_dim {hd}, not a power of two; the Walsh-Hadamard "
                    f"rotation is only defined for powers of two and infeng does not pad heads (it would grow the "
                    f"KV cache); use --kv int8 or --kv int4 without fht")
            self.fold_v(graph, node)
            node.attrs["rotate_qk"] = True
            changed = True
        used = {w.name for n in graph.nodes for w in n.weights}
        for name in [n for n in graph.weights if n not in used]:
            del graph.weights[name]
        return changed

    # -- V: rows of v_proj, columns of o_proj -----------------------------------------------
    def fold_v(self, graph: Graph, attn: Node) -> None:
        a = attn.attrs
        h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        H = hadamard(hd)
        producers, users = graph.producers(), graph.users()
        where = f"fht-kv: layer {a['layer']}"
        v = attn.inputs[2]
        proj, row0 = self.v_projection(v, producers, users, where)
        rows = slice(row0, row0 + kvh * hd)

        def rotate_rows(w: np.ndarray) -> np.ndarray:       # [kvh*hd, ...] per head: H @ w_head
            lead = w.shape[1:]
            heads = w.reshape(kvh, hd, -1).astype(np.float64)
            return np.einsum("ij,hjk->hik", H, heads).reshape(kvh * hd, *lead)

        weights = [w.numpy_f32().copy() for w in proj.weights]
        weights[0][rows] = rotate_rows(weights[0][rows])
        if len(weights) > 1:
            weights[1][rows] = rotate_rows(weights[1][rows])
        proj.weights = [self.rotated(graph, w, arr) for w, arr in zip(proj.weights, weights)]

        readers = users.get(attn.output.name, [])
        if len(readers) != 1 or readers[0].op != "linear" or readers[0].inputs[0] is not attn.output:
            raise InfengError(f"{where}: cannot fold V's rotation: %{attn.output.name} must be read by exactly "
                              f"one linear (o_proj), found {', '.join(r.op for r in readers) or 'none'}")
        o = readers[0]
        w = o.weights[0].numpy_f32().astype(np.float64)
        heads = w.reshape(w.shape[0], h, hd)
        folded = np.einsum("ohj,jk->ohk", heads, H).reshape(w.shape)
        o.weights = [self.rotated(graph, o.weights[0], folded)] + o.weights[1:]

    @staticmethod
    def v_projection(v, producers, users, where: str) -> tuple[Node, int]:
        """The linear whose rows produce V, and the first of those rows (a fused QKV is split)."""
        node = producers.get(v.name)
        if node is not None and node.op == "split":
            sizes = node.attrs["sizes"]
            index = [o.name for o in node.outputs].index(v.name)
            parent = producers.get(node.inputs[0].name)
            if parent is not None and parent.op == "linear" and len(users[node.inputs[0].name]) == 1:
                return parent, sum(sizes[:index])
            node = parent
        elif node is not None and node.op == "linear" and len(users[v.name]) == 1:
            return node, 0
        what = "a graph input" if node is None else f"a {node.op}"
        hint = " (LoRA slots: adapters are not rotated; use --kv int8/int4 without fht)" \
            if node is not None and node.op == "lora_linear" else ""
        raise InfengError(f"{where}: cannot fold V's rotation: %{v.name} comes from {what}, not a plain linear "
                          f"read only by this attention{hint}")

    @staticmethod
    def rotated(graph: Graph, old: Weight, array: np.ndarray) -> Weight:
        name = f"{old.name}+fht"
        new = Weight(name, TensorType("f32", old.type.shape), array=np.ascontiguousarray(array, dtype=np.float32),
                     attrs={k: v for k, v in old.attrs.items() if k == "format"})
        graph.weights.pop(name, None)
        graph.add_weight(new)
        return new


# ---------------------------------------------------------------------------------------------
# the --kv presets of ``infeng compile`` and what the manifest records
KV_SCHEMES = ("f32", "f16", "int8", "int4", "fht-int8", "fht-int4")


def kv_entries(scheme: str, window: int = 0, calib: str | Path | None = None,
               calib_max_bytes: int | None = None) -> list[tuple[str, list[str]]]:
    """The pipeline entries for ``--kv SCHEME [--kv-window N] [--calib FILE [--calib-max-bytes N]]``:
    none for the plain f32 cache, ``kv-format(...)``, or ``fht-kv`` then ``kv-format(...)``. ``calib`` centres K (int8/int4 only; ignored otherwise, where
    ``--calib`` may still serve ``--quant``)."""
    if scheme not in KV_SCHEMES:
        raise InfengError(f"--kv {scheme!r}: expected one of {', '.join(KV_SCHEMES)}")
    rotate, _, fmt = scheme.rpartition("-")
    if window < 0:
        raise InfengError(f"--kv-window must be >= 0, got {window}")
    if window and fmt not in QUANTIZED:
        raise InfengError(f"--kv-window keeps recent tokens in f16 next to an int8/int4 cache; "
                          f"--kv {scheme} has nothing to keep (use --kv int8, int4, fht-int8 or fht-int4)")
    if fmt == "f32":
        return []
    args = [fmt] + ([f"window={window}"] if window else [])
    if calib is not None and fmt in QUANTIZED:
        args += calibration_args(calib, calib_max_bytes)
    return ([("fht-kv", [])] if rotate else []) + [("kv-format", args)]


def kv_summary(graph: Graph, kv_layers: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    """The manifest's ``kv`` section: formats of the first attention layer and bytes over all layers."""
    from ..quant.kv import attention_kv_formats

    attn = next(graph.find("attention"), None)
    if attn is None:
        return {"scheme": "none", "bytes_per_token": 0}
    k, v, group = attention_kv_formats(attn.attrs)
    rotate = bool(attn.attrs.get("rotate_qk"))
    scheme = ("fht-" if rotate else "") + (k if k == v else f"{k}/{v}")
    return {"scheme": scheme, "k_format": k, "v_format": v, "group": group, "rotate": rotate,
            "window": attn.attrs.get("kv_window", 0), "k_centred": bool(attn.weights), "block_size": block_size,
            "bytes_per_token": sum(layer["k_bytes"] + layer["v_bytes"] for layer in kv_layers) / block_size,
            "ring_bytes_per_slot": 2 * sum(layer["k_ring"] + layer["v_ring"] for layer in kv_layers)}

"""Pass ``raise``: turn the primitive subgraphs of an imported ONNX decoder back into the IR's
transformer ops, so that it runs on the same kernels as a Hugging Face import.

Rules (``docs/onnx.md`` lists the patterns each accepts):

    gather(const [V,H], token ids | 0..T-1)                  -> embedding(%tokens | %positions)
    matmul(x, const [K,N]) (+ const bias), gemm(...)         -> linear (weight [N,K]: transposed view)
    ... the same feeding the graph output                    -> logits
    split_nd(x) on the last axis                             -> split
    x * rsqrt(mean(x^2) + eps) * w                           -> rms_norm
    layer_normalization(x, w, b)                             -> layer_norm
    softmax(q.k^T * s + causal mask) . v  (+ rotate_half
      rope with cos/sin of the positions, GQA repeat_kv)     -> rope, rope, attention
    silu(g) * u, with silu = g * sigmoid(g)                  -> silu_mul
    0.5 x (1 + tanh(...)) / 0.5 x (1 + erf(...)), gelu       -> gelu
    add_nd of two activation rows                            -> add

Values in the ONNX graph carry a batch dimension of 1 (``[1,T,H]``); raised ops take rows
(``[T,H]``), as the Hugging Face graph does. A raised result replaces the old value through an
``add_batch`` bridge, so unraised consumers keep working; a raised op looks through bridges and
reshapes to the rows beneath. Every rewrite is checked by value: the pass evaluates the graph for
one probe sequence and keeps a replacement only if it reproduces the old value (within
``tolerance``), so a rule that matched a structure it misunderstands changes nothing. Causal masks
and rotary tables are recognised by value too (they depend only on the sequence length).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..interp import Interpreter
from ..ir import Graph, Node, TensorType, Value, Weight
from ..ir.ops import const_array, rope_inv_freq
from .context import PassContext
from .rewrite import PROBE_LENGTHS, dead_code_elimination, evaluate, length_only_values, make_node, place, probe_step

_LAYOUT = ("reshape", "transpose", "unsqueeze", "squeeze", "expand", "identity", "add_batch", "drop_batch")


class _NoMatch(Exception):
    pass


def _need(cond: Any) -> None:
    if not cond:
        raise _NoMatch


class Raise:
    name = "raise"
    #: max |change of any raised value| / max |value| (float32 evaluation order only)
    tolerance = 1e-4

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return _Raiser(graph, self.tolerance).run()


class _Raiser:
    def __init__(self, graph: Graph, tolerance: float):
        self.g, self.tol = graph, tolerance
        self.length = PROBE_LENGTHS[0]
        self.env = evaluate(graph, self.length)
        self.static = length_only_values(graph)
        self.positions = next(v for v in graph.inputs if v.name == "positions")
        self.tokens = next(v for v in graph.inputs if v.name == "tokens")
        self.layers = 0
        self.recognised: dict[str, int] = {}
        self.renames: dict[str, str] = {}

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> bool:
        rules = {"gather": self.embedding, "matmul": self.linear, "gemm": self.linear, "split_nd": self.split,
                 "mul": self.mul_root, "layer_normalization": self.layer_norm, "softmax": self.attention,
                 "gelu": self.gelu_op}
        changed = self.sweep(rules)
        changed |= self.sweep({"add_nd": self.add})
        self.collapse_bridges()
        dead_code_elimination(self.g)
        for name, desired in self.renames.items():
            if name in self.g.weights and desired not in self.g.weights:
                w = self.g.weights.pop(name)
                w.name = desired
                self.g.weights[desired] = w
        self.record_meta()
        return changed

    def sweep(self, rules) -> bool:
        changed = False
        for node in list(self.g.nodes):
            if node not in self.g.nodes or node.op not in rules:
                continue
            self.producers = self.g.producers()
            self.users = self.g.users()
            try:
                changed |= rules[node.op](node)
            except _NoMatch:
                pass
        return changed

    # -- graph helpers --------------------------------------------------------------------
    def prod(self, v: Value) -> Node | None:
        return self.producers.get(v.name)

    def op_of(self, v: Value) -> str | None:
        p = self.prod(v)
        return p.op if p else None

    def const_value(self, v: Value) -> np.ndarray | None:
        """The array of a ``const`` (inline or weight) value, else None."""
        p = self.prod(v)
        if p is None or p.op != "const":
            return None
        return np.asarray(p.weights[0].raw()) if p.weights else const_array(p.attrs, self.length)

    def scalar(self, v: Value) -> float | None:
        c = self.const_value(v)
        return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None

    def weight_of(self, v: Value) -> Weight | None:
        """The weight behind a value: ``const(@w)``, or an inline float constant made a weight."""
        p = self.prod(v)
        if p is None or p.op != "const":
            return None
        if p.weights:
            return p.weights[0]
        arr = const_array(p.attrs, self.length)
        if arr.dtype != np.float32:
            return None
        return self.g.add_weight(Weight(self.g.fresh(v.name), TensorType("f32", arr.shape),
                                        array=np.ascontiguousarray(arr)))

    def single_user(self, v: Value) -> Node | None:
        users = self.users.get(v.name, [])
        return users[0] if len(users) == 1 and v not in self.g.outputs else None

    @staticmethod
    def is_rows(t: TensorType) -> bool:
        return t.dtype == "f32" and len(t.shape) == 2 and t.shape[0] == "T" and isinstance(t.shape[1], int)

    @staticmethod
    def is_batched_rows(t: TensorType) -> bool:
        return t.dtype == "f32" and len(t.shape) == 3 and t.shape[:2] == (1, "T") and isinstance(t.shape[2], int)

    def row_source(self, v: Value) -> Value:
        """``v`` seen through batch-of-one layout ops: the deepest equivalent rows value, else the
        deepest equivalent batched one."""
        width = v.type.shape[-1]
        best = v
        while True:
            p = self.prod(v)
            if p is None or p.op not in _LAYOUT or not p.inputs:
                break
            src = p.inputs[0]
            if not (self.is_rows(src.type) or self.is_batched_rows(src.type)) or src.type.shape[-1] != width:
                break
            v = src
            if self.is_rows(v.type) or not self.is_rows(best.type):
                best = v
        return best

    def rows(self, v: Value, new: list[Node]) -> Value:
        """A ``[T,X]`` value equal to ``v`` (``[T,X]`` or ``[1,T,X]``), adding ``drop_batch`` if needed."""
        src = self.row_source(v)
        if self.is_rows(src.type):
            return src
        _need(self.is_batched_rows(src.type))
        node = make_node(self.g, "drop_batch", [src], name=src.name + ".rows")
        new.append(node)
        return node.output

    def emit(self, new: list[Node], op: str, inputs: list[Value], weights=None, attrs=None, name=None) -> Value:
        node = make_node(self.g, op, inputs, weights, attrs, name=name)
        new.append(node)
        return node.output

    def commit(self, root: Node, old: Value, new_value: Value, new: list[Node], kind: str,
               compare_rows: bool = False) -> bool:
        """Check the replacement by value, then splice it in before ``root`` and bridge ``old``."""
        env = Interpreter(self.g).run(dict(self.env), probe_step(self.length), new)
        want = np.asarray(self.env[old.name], dtype=np.float64)
        got = np.asarray(env[new_value.name], dtype=np.float64)
        if compare_rows:
            want = want.reshape(got.shape) if want.size == got.size else want
        if got.size != want.size or np.abs(got.reshape(want.shape) - want).max() > self.tol * max(np.abs(want).max(), 1e-30):
            return False
        if old.type.shape == new_value.type.shape or old in self.g.outputs and kind == "logits":
            replacement = new_value
        else:
            _need(old.type.shape == (1,) + new_value.type.shape)
            bridge = make_node(self.g, "add_batch", [new_value], name=old.name + ".b")
            new.append(bridge)
            env[bridge.output.name] = env[new_value.name][None]
            replacement = bridge.output
        place(self.g, new, root)
        self.g.replace_uses(old, replacement)
        self.env.update(env)
        self.recognised[kind] = self.recognised.get(kind, 0) + 1
        return True

    # -- embedding ------------------------------------------------------------------------
    def embedding(self, node: Node) -> bool:
        data, ids = node.inputs
        _need(node.attrs.get("axis", 0) == 0 and ids.type.shape in ((1, "T"), ("T",)))
        w = self.weight_of(data)
        _need(w is not None and w.type.rank == 2 and w.type.dtype in ("f32", "f16", "bf16"))
        src = ids
        while self.prod(src) is not None and self.prod(src).op in _LAYOUT + ("cast",):
            src = self.prod(src).inputs[0]
        if src is self.tokens:
            which = self.tokens
        elif ids.name in self.static and np.array_equal(self.env[ids.name].reshape(-1), np.arange(self.length)):
            which = self.positions
        else:
            raise _NoMatch
        new: list[Node] = []
        name = "embed" if which is self.tokens else "pos_embed"
        out = self.emit(new, "embedding", [which], [w], name=name)
        return self.commit(node, node.output, out, new, "embedding")

    # -- linear / logits ------------------------------------------------------------------
    def linear(self, node: Node) -> bool:
        x, b = node.inputs[0], node.inputs[1]
        if node.op == "gemm":
            a = node.attrs
            _need(not a.get("transA") and a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0)
            trans_b = bool(a.get("transB"))
        else:
            trans_b = False
        w, stored_out_in = self.matrix(b, trans_b)
        _need(w is not None and x.type.shape[-1] == (w.type.shape[1] if stored_out_in else w.type.shape[0]))
        root, out_value = node, node.output
        bias = None
        if node.op == "gemm" and len(node.inputs) > 2:
            bias = self.weight_of(node.inputs[2])
            _need(bias is not None and bias.type.rank == 1)
        elif node.op == "matmul":
            user = self.single_user(node.output)
            if user is not None and user.op == "add_nd":
                other = user.inputs[1] if user.inputs[0] is node.output else user.inputs[0]
                cand = self.weight_of(other) if other.type.rank == 1 else None
                if cand is not None and user.output.type == node.output.type:
                    bias, root, out_value = cand, user, user.output
        weight = self.out_in_weight(w, stored_out_in, node.attrs.get("module"))
        new: list[Node] = []
        rows = self.rows(x, new)
        module = node.attrs.get("module", "")
        if out_value in self.g.outputs and bias is None:
            out = self.emit(new, "logits", [rows], [weight], name="logits")
            if not self.commit(root, out_value, out, new, "logits", compare_rows=True):
                return False
            self.g.outputs = [out]
            return True
        ws = [weight] + ([bias] if bias is not None else [])
        out = self.emit(new, "linear", [rows], ws, name=module.split(".", 1)[-1] if module else "linear")
        return self.commit(root, out_value, out, new, "linear")

    def matrix(self, b: Value, trans_b: bool) -> tuple[Weight | None, bool]:
        """The weight of a matmul's right operand and whether it is stored [out, in]."""
        p = self.prod(b)
        if p is not None and p.op == "transpose" and p.attrs.get("perm", [1, 0]) == [1, 0]:
            w = self.weight_of(p.inputs[0])
            return (w, not trans_b) if w is not None and w.type.rank == 2 else (None, False)
        w = self.weight_of(b)
        return (w, trans_b) if w is not None and w.type.rank == 2 else (None, False)

    def out_in_weight(self, w: Weight, stored_out_in: bool, module: str | None) -> Weight:
        """``w`` as the [out, in] weight ``linear`` takes: itself, or a transposed view (no copy)."""
        if stored_out_in:
            return w
        name = f"{module}.weight" if module else w.name + ".t"
        existing = self.g.weights.get(name)
        if existing is not None and existing.file == w.file and existing.offset == w.offset and \
                existing.transposed != w.transposed and w.array is None:
            return existing
        desired = name
        while name in self.g.weights:
            name += ".t"
        if name != desired:
            self.renames[name] = desired      # taken now, maybe free once the primitive is gone
        out, inp = w.type.shape[1], w.type.shape[0]
        t = Weight(name, TensorType(w.type.dtype, (out, inp)), file=w.file, offset=w.offset,
                   transposed=not w.transposed, array=None if w.array is None else w.array.T, attrs=dict(w.attrs))
        return self.g.add_weight(t)

    # -- split ----------------------------------------------------------------------------
    def split(self, node: Node) -> bool:
        x = node.inputs[0]
        _need(node.attrs.get("axis", 0) in (-1, x.type.rank - 1))
        _need(all(self.is_rows(o.type) or self.is_batched_rows(o.type) for o in node.outputs))
        new: list[Node] = []
        rows = self.rows(x, new)
        sizes = [o.type.shape[-1] for o in node.outputs]
        split = make_node(self.g, "split", [rows], attrs={"sizes": sizes},
                          out_names=[self.g.fresh(o.name + ".r") for o in node.outputs])
        new.append(split)
        env = Interpreter(self.g).run(dict(self.env), probe_step(self.length), new)
        for o, r in zip(node.outputs, split.outputs):
            if not np.array_equal(env[r.name].reshape(-1), self.env[o.name].reshape(-1)):
                return False
        self.env.update(env)
        place(self.g, new, node)
        for o, r in zip(node.outputs, split.outputs):
            bridged = r
            if o.type.shape != r.type.shape:
                bridge = make_node(self.g, "add_batch", [r], name=o.name + ".b")
                place(self.g, [bridge], node)
                self.env[bridge.output.name] = self.env[r.name][None]
                bridged = bridge.output
            self.g.replace_uses(o, bridged)
        self.recognised["split"] = self.recognised.get("split", 0) + 1
        return True

    # -- norms ----------------------------------------------------------------------------
    def mul_root(self, node: Node) -> bool:
        for rule in (self.rms_norm, self.silu_mul, self.gelu):
            try:
                if rule(node):
                    return True
            except _NoMatch:
                continue
        return False

    def operands(self, node: Node, op: str) -> list[tuple[Node, Value]]:
        """(producer of operand i with ``op``, the other operand) for each operand that matches."""
        out = []
        for i, v in enumerate(node.inputs):
            p = self.prod(v)
            if p is not None and p.op == op:
                out.append((p, node.inputs[1 - i]))
        return out

    def rms_norm(self, node: Node) -> bool:
        _need(self.is_batched_rows(node.output.type) or self.is_rows(node.output.type))
        for a, b in (node.inputs, node.inputs[::-1]):
            w = self.weight_of(a) if a.type.rank == 1 else None
            if w is None:
                continue
            normed = self.prod(b)
            if normed is None:
                continue
            found = self.rms_core(normed)
            if found is None:
                continue
            x, eps = found
            new: list[Node] = []
            out = self.emit(new, "rms_norm", [self.rows(x, new)], [w], {"eps": eps}, name="rms_norm")
            return self.commit(node, node.output, out, new, "rms_norm")
        raise _NoMatch

    def rms_core(self, normed: Node) -> tuple[Value, float] | None:
        """x * rsqrt(mean(x^2) + eps) (or x / sqrt(...)) -> (x, eps)."""
        if normed.op == "div":
            x, s = normed.inputs
            den = self.prod(s)
            if den is None or den.op != "sqrt":
                return None
            return self.mean_square(den.inputs[0], x)
        if normed.op != "mul":
            return None
        for x, r in (normed.inputs, normed.inputs[::-1]):
            p = self.prod(r)
            if p is None:
                continue
            if p.op == "reciprocal" and self.op_of(p.inputs[0]) == "sqrt":
                found = self.mean_square(self.prod(p.inputs[0]).inputs[0], x)
            elif p.op == "div" and self.scalar(p.inputs[0]) == 1.0 and self.op_of(p.inputs[1]) == "sqrt":
                found = self.mean_square(self.prod(p.inputs[1]).inputs[0], x)
            elif p.op == "pow" and self.scalar(p.inputs[1]) == -0.5:
                found = self.mean_square(p.inputs[0], x)
            else:
                found = None
            if found is not None:
                return found
        return None

    def mean_square(self, v: Value, x: Value) -> tuple[Value, float] | None:
        """``v`` = mean(x^2, last axis) + eps -> (x, eps)."""
        p = self.prod(v)
        if p is None or p.op != "add_nd":
            return None
        for m, e in (p.inputs, p.inputs[::-1]):
            eps, mean = self.scalar(e), self.prod(m)
            if eps is None or mean is None or mean.op != "reduce_mean":
                continue
            axes = self.const_value(mean.inputs[1]) if len(mean.inputs) > 1 else mean.attrs.get("axes_attr")
            if axes is None or [int(a) for a in np.asarray(axes).reshape(-1)] not in ([-1], [x.type.rank - 1]):
                continue
            sq = self.prod(mean.inputs[0])
            if sq is None:
                continue
            if (sq.op == "pow" and sq.inputs[0] is x and self.scalar(sq.inputs[1]) == 2.0) or \
                    (sq.op == "mul" and sq.inputs[0] is x and sq.inputs[1] is x):
                return x, eps
        return None

    def layer_norm(self, node: Node) -> bool:
        x = node.inputs[0]
        _need(node.attrs.get("axis", -1) in (-1, x.type.rank - 1))
        w = self.weight_of(node.inputs[1])
        bias = self.weight_of(node.inputs[2]) if len(node.inputs) > 2 else None
        _need(w is not None and w.type.rank == 1)
        if bias is None:
            bias = self.g.add_weight(Weight(self.g.fresh(w.name + ".zero_bias"), w.type,
                                            array=np.zeros(w.type.shape, np.float32)))
        new: list[Node] = []
        out = self.emit(new, "layer_norm", [self.rows(x, new)], [w, bias], {"eps": float(node.attrs.get("epsilon", 1e-5))},
                        name="layer_norm")
        return self.commit(node, node.output, out, new, "layer_norm")

    # -- activations ----------------------------------------------------------------------
    def silu_mul(self, node: Node) -> bool:
        for silu, up in self.operands(node, "mul"):
            for g, s in (silu.inputs, silu.inputs[::-1]):
                sp = self.prod(s)
                if sp is not None and sp.op == "sigmoid" and sp.inputs[0] is g:
                    new: list[Node] = []
                    out = self.emit(new, "silu_mul", [self.rows(g, new), self.rows(up, new)], name="silu_mul")
                    if self.commit(node, node.output, out, new, "silu_mul"):
                        return True
        raise _NoMatch

    def gelu(self, node: Node) -> bool:
        """0.5 x (1 + tanh(..)) or 0.5 x (1 + erf(..)): the candidates for x are checked by value."""
        _need(self.is_batched_rows(node.output.type) or self.is_rows(node.output.type))
        for one_plus, other in self.operands(node, "add_nd"):
            kinds = {self.op_of(v) for v in one_plus.inputs}
            approximate = "tanh" if "tanh" in kinds else "none" if "erf" in kinds else None
            if approximate is None:
                continue
            candidates = [other]
            p = self.prod(other)
            if p is not None and p.op in ("mul", "div"):
                candidates += [v for v in p.inputs if self.const_value(v) is None]
            for x in candidates:
                if x.type.shape != node.output.type.shape:
                    continue
                new: list[Node] = []
                out = self.emit(new, "gelu", [self.rows(x, new)], attrs={"approximate": approximate}, name="gelu")
                if self.commit(node, node.output, out, new, "gelu"):
                    return True
        raise _NoMatch

    def gelu_op(self, node: Node) -> bool:
        """ONNX Gelu (opset 20) imports as the IR op on batched rows: move it onto rows."""
        _need(self.is_batched_rows(node.output.type))
        new: list[Node] = []
        out = self.emit(new, "gelu", [self.rows(node.inputs[0], new)], attrs=dict(node.attrs), name="gelu")
        return self.commit(node, node.output, out, new, "gelu")

    def add(self, node: Node) -> bool:
        a, b = node.inputs
        _need(a.type == b.type == node.output.type)
        _need(self.is_rows(a.type) or self.is_batched_rows(a.type))
        _need(a.name not in self.static and b.name not in self.static)
        new: list[Node] = []
        out = self.emit(new, "add", [self.rows(a, new), self.rows(b, new)], name="add")
        return self.commit(node, node.output, out, new, "add")

    # -- attention ------------------------------------------------------------------------
    def attention(self, node: Node) -> bool:
        _need(node.attrs.get("axis", -1) in (-1, 3) and node.inputs[0].type.rank == 4)
        scale = 1.0
        logits = node.inputs[0]
        mask = None
        p = self.prod(logits)
        if p is not None and p.op == "add_nd":
            for s, m in (p.inputs, p.inputs[::-1]):
                if m.name in self.static and self.op_of(s) in ("matmul", "mul", "div"):
                    mask, logits = m, s
                    break
        elif p is not None and p.op == "where" and p.inputs[0].name in self.static:
            mask, logits = p.inputs[0], p.inputs[1]
        _need(mask is not None and self.is_causal(mask))
        logits, scale = self.peel_scale(logits, scale)
        qk = self.prod(logits)
        _need(qk is not None and qk.op == "matmul")
        q4, kt = qk.inputs
        # the P.V product: the softmax result, possibly through where(isnan(p), 0, p)
        pv = self.pv_matmul(node.output)
        v4 = pv.inputs[1]
        out_value, _chain = self.merged_heads(pv.output)
        q_src, q_rope, scale = self.trace_heads(q4, scale)
        k_src, k_rope, scale = self.trace_heads(kt, scale)
        v_src, v_rope, scale = self.trace_heads(v4, scale)
        _need(v_rope is None and (q_rope is None) == (k_rope is None))
        heads, head_dim = q4.type.shape[1], q4.type.shape[3]
        _need(isinstance(heads, int) and isinstance(head_dim, int))
        _need(q_src.type.shape[-1] == heads * head_dim and k_src.type.shape[-1] % head_dim == 0)
        kv_heads = k_src.type.shape[-1] // head_dim
        if abs(scale * math.sqrt(head_dim) - 1.0) <= 1e-6:   # sqrt(s) on q and k each, in float32
            scale = 1.0 / math.sqrt(head_dim)
        new: list[Node] = []
        q, k, v = (self.rows(x, new) for x in (q_src, k_src, v_src))
        layer = self.layers
        if q_rope is not None:
            attrs = self.rope_attrs(q_rope, head_dim)
            _need(attrs is not None and attrs == self.rope_attrs(k_rope, head_dim))
            q = self.emit(new, "rope", [q, self.positions], attrs={"n_heads": heads, **attrs}, name=f"l{layer}.q_rot")
            k = self.emit(new, "rope", [k, self.positions], attrs={"n_heads": kv_heads, **attrs}, name=f"l{layer}.k_rot")
        out = self.emit(new, "attention", [q, k, v, self.positions], name=f"l{layer}.attn",
                        attrs={"layer": layer, "n_heads": heads, "n_kv_heads": kv_heads, "head_dim": head_dim,
                               "scale": scale})
        root = self.prod(out_value)
        if not self.commit(root, out_value, out, new, "attention"):
            return False
        if q_rope is not None:
            self.recognised["rope"] = self.recognised.get("rope", 0) + 2
        self.layers += 1
        return True

    def is_causal(self, mask: Value) -> bool:
        """A static mask that lets position i see exactly positions j <= i (additive or boolean)."""
        m = np.asarray(self.env[mask.name])
        n = self.length
        if m.shape[-2:] != (n, n):
            return False
        m = m.reshape(-1, n, n)
        allowed = np.tril(np.ones((n, n), dtype=bool))
        if m.dtype == bool:
            return bool(np.all(m == allowed))
        return bool(np.all(m[:, allowed] == 0) and np.all(m[:, ~allowed] <= -1e4))

    def peel_scale(self, v: Value, scale: float) -> tuple[Value, float]:
        while True:
            p = self.prod(v)
            if p is None or p.op not in ("mul", "div"):
                return v, scale
            c = [self.scalar(x) for x in p.inputs]
            if p.op == "mul" and c[1] is not None:
                v, scale = p.inputs[0], scale * c[1]
            elif p.op == "mul" and c[0] is not None:
                v, scale = p.inputs[1], scale * c[0]
            elif p.op == "div" and c[1] is not None:
                v, scale = p.inputs[0], scale / c[1]
            else:
                return v, scale

    def pv_matmul(self, probs: Value) -> Node:
        for user in self.users.get(probs.name, []):
            if user.op == "matmul" and user.inputs[0] is probs:
                return user
            if user.op == "where" and user.inputs[2] is probs:
                for u2 in self.users.get(user.output.name, []):
                    if u2.op == "matmul" and u2.inputs[0] is user.output:
                        return u2
        raise _NoMatch

    def merged_heads(self, v: Value) -> tuple[Value, list[Node]]:
        """Follow the attention output through transpose/reshape to the [1,T,H*D] (or [T,H*D]) value."""
        chain = []
        while not (self.is_batched_rows(v.type) or self.is_rows(v.type)):
            user = self.single_user(v)
            _need(user is not None and user.op in _LAYOUT)
            chain.append(user)
            v = user.output
        return v, chain

    def trace_heads(self, v: Value, scale: float) -> tuple[Value, tuple[Value, Value] | None, float]:
        """Back from a per-head tensor to the rows it was split from; collects scalar factors and the
        rotary (cos, sin) tables if a rotate_half rope sits on the way."""
        rope = None
        for _ in range(64):
            if self.is_batched_rows(v.type) or self.is_rows(v.type):
                return v, rope, scale
            p = self.prod(v)
            _need(p is not None)
            if p.op in _LAYOUT:
                v = p.inputs[0]
            elif p.op in ("mul", "div") and any(self.scalar(x) is not None for x in p.inputs):
                v, scale = self.peel_scale(v, scale)
            elif p.op == "add_nd" and rope is None:
                found = self.rope_tables(p)
                _need(found is not None)
                v, rope = found
            else:
                raise _NoMatch
        raise _NoMatch

    def rope_tables(self, add: Node) -> tuple[Value, tuple[Value, Value]] | None:
        """x*cos + rotate_half(x)*sin -> (x, (cos, sin)); cos/sin depend only on the positions."""
        terms = []
        for t in add.inputs:
            p = self.prod(t)
            if p is None or p.op != "mul":
                return None
            a, b = p.inputs
            if a.name in self.static and b.name not in self.static:
                a, b = b, a
            if b.name not in self.static:
                return None
            terms.append((a, b))
        for (x, cos), (rot, sin) in (terms, terms[::-1]):
            p = self.prod(rot)
            if p is not None and p.op == "concat" and self.rotate_half_of(p) is x:
                return x, (cos, sin)
        return None

    def rotate_half_of(self, concat: Node) -> Value | None:
        """concat(-x2, x1) with x1, x2 halves of the same x -> x."""
        sources = set()
        for v in concat.inputs:
            p = self.prod(v)
            while p is not None and p.op in ("neg", "slice"):
                v = p.inputs[0]
                p = self.prod(v)
            sources.add(v)
        return sources.pop() if len(sources) == 1 else None

    def rope_attrs(self, tables: tuple[Value, Value], head_dim: int) -> dict[str, Any] | None:
        """theta (or the inverse-frequency table) that reproduces the probe's cos/sin tables."""
        cos = np.asarray(self.env[tables[0].name], dtype=np.float64)
        sin = np.asarray(self.env[tables[1].name], dtype=np.float64)
        n = self.length
        if cos.shape[-1] != head_dim or cos.size != n * head_dim or sin.shape != cos.shape:
            return None
        cos, sin = cos.reshape(n, head_dim), sin.reshape(n, head_dim)
        half = head_dim // 2
        if not np.allclose(cos[:, :half], cos[:, half:]) or not np.allclose(cos[0], 1.0, atol=1e-6):
            return None
        approx = np.arctan2(sin[1, :half], cos[1, :half])
        inv = self.exact_inv_freq(tables, approx)
        theta = float(np.exp(-np.log(inv[1]) * head_dim / 2)) if half > 1 else 10000.0
        for candidate in (round(theta), float(f"{theta:.6g}"), theta):
            attrs = {"head_dim": head_dim, "theta": float(candidate)}
            if np.array_equal(rope_inv_freq(attrs), inv):
                return attrs
        return {"head_dim": head_dim, "theta": float(theta), "inv_freq": [float(f) for f in inv]}

    def exact_inv_freq(self, tables: tuple[Value, Value], approx: np.ndarray) -> np.ndarray:
        """The float32 constant the tables were computed from, when one matches; else the estimate."""
        seen, stack = set(), [tables[0]]
        while stack:
            v = stack.pop()
            if v.name in seen:
                continue
            seen.add(v.name)
            c = self.const_value(v)
            if c is not None and c.dtype == np.float32 and c.size == approx.size:
                flat = c.reshape(-1)
                if np.allclose(flat, approx, rtol=1e-4, atol=1e-7):
                    return flat.astype(np.float32)
            p = self.prod(v)
            if p is not None:
                stack.extend(p.inputs)
        return approx.astype(np.float32)

    def collapse_bridges(self) -> None:
        """drop_batch(add_batch(x)) -> x, left where a consumer was raised before its producer."""
        producers = self.g.producers()
        for n in self.g.nodes:
            if n.op == "drop_batch":
                p = producers.get(n.inputs[0].name)
                if p is not None and p.op == "add_batch":
                    self.g.replace_uses(n.output, p.inputs[0])

    # -- meta -----------------------------------------------------------------------------
    def record_meta(self) -> None:
        meta = self.g.meta
        attn = [n for n in self.g.nodes if n.op == "attention"]
        embed = next((n for n in self.g.nodes if n.op == "embedding" and n.inputs[0] is self.tokens), None)
        if embed is not None:
            meta["hidden_size"] = embed.weights[0].type.shape[1]
        if attn:
            a = attn[0].attrs
            meta.update({"num_layers": len(attn), "num_heads": a["n_heads"], "num_kv_heads": a["n_kv_heads"],
                         "head_dim": a["head_dim"]})
        meta["raised"] = dict(sorted(self.recognised.items()))

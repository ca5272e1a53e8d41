"""ONNX frontend: an exported decoder (``model.onnx``, external data supported) -> IR graph of
primitive ops, one per ONNX node, with ONNX semantics (see the primitive section of ``ir/ops.py``).

The graph computes full-sequence logits of one sequence from ``input_ids`` (no KV cache); the
``fold-shapes`` and ``raise`` passes turn it into the incremental transformer graph that
``frontends/hf.py`` builds (``docs/onnx.md``).

Types: ONNX shapes are partly symbolic (``seq``, ``seq + 1``) and partly data-dependent (a
Reshape's target is a tensor). The importer evaluates every node with the primitive ops' numpy
references at two probe lengths and declares each result's type from the two shapes: a
dimension equal at both is a constant, one that grows with the sequence is ``T`` (or ``T+k``).
Anything else is reported. Weights stay where they are: external data is memory-mapped from its
file at its offset, embedded initializers are held as arrays.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import ModelFormatError, UnsupportedError, not_a_file

from ..ir import Graph, TensorType, Value, Weight
from ..ir.ops import DTYPE_NUMPY, ONNX_PRIMITIVES
from ..ir.ops import get as get_op
from ..passes.rewrite import INLINE_LIMIT, PROBE_LENGTHS

#: ONNX TensorProto data types -> IR element types.
ONNX_DTYPES = {1: "f32", 6: "i32", 7: "i64", 9: "bool", 10: "f16", 11: "f64", 16: "bf16"}
_NUMPY_TO_IR = {np.dtype(v): k for k, v in DTYPE_NUMPY.items()}
#: ONNX operators handled besides the primitive table (Constant becomes ``const``; Gelu is the IR op).
EXTRA_OPS = ("Constant", "Gelu")
#: ONNX input names (lower case) taken as the token ids, the positions, the attention mask.
TOKEN_INPUTS = ("input_ids", "tokens", "input")
POSITION_INPUTS = ("position_ids", "positions")
MASK_INPUTS = ("attention_mask",)


def supported_onnx_ops() -> list[str]:
    return sorted(set(ONNX_PRIMITIVES) | set(EXTRA_OPS))


def load_onnx(path: str | Path) -> Graph:
    """Import ``path`` as a primitive graph: inputs ``%tokens``, ``%positions``; output: the logits
    ``[1, T, vocab]`` of every position."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(not_a_file(path))
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError
        raise ModelFormatError(f"{path}: not a readable ONNX model: {e}") from None
    if model.functions:
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    return _Importer(path, model).run()


def _ir_name(text: str) -> str:
    name = re.sub(r"[^\w.\-]", "_", text) or "v"
    return name if re.match(r"[A-Za-z_]", name) else "v" + name


class _Importer:
    def __init__(self, path: Path, model):
        self.path, self.model, self.onnx_graph = path, model, model.graph
        self.g = Graph(_ir_name(path.stem))
        self.values: dict[str, Value] = {}                 # ONNX name -> IR value
        self.probe: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # IR value name -> arrays at both lengths
        self.inits = {t.name: t for t in self.onnx_graph.initializer}

    # -- entry ----------------------------------------------------------------------------
    def run(self) -> Graph:
        import onnx

        og = self.onnx_graph
        domains = {o.domain for o in self.model.opset_import if o.domain not in ("", "ai.onnx")}
        counts = Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in og.node)
        known = set(ONNX_PRIMITIVES) | set(EXTRA_OPS)
        unsupported = sorted(op for op in counts if op not in known)
        if unsupported:
            listed = ", ".join(f"{op} (x{counts[op]})" for op in unsupported)
            raise UnsupportedError(f"{self.path}: {len(unsupported)} ONNX operator(s) not supported: {listed}. "
                                   f"Supported: {', '.join(supported_onnx_ops())}"
                                   + (f"; custom domains {sorted(domains)}" if domains else ""))
        self.vocab = self.vocab_size()
        self.bind_inputs()
        for node in og.node:
            self.convert(node, onnx)
        if not og.output:
            raise ModelFormatError(f"{self.path}: the graph has no outputs")
        if len(og.output) > 1:
            extra = ", ".join(o.name for o in og.output[1:])
            raise UnsupportedError(f"{self.path}: outputs besides the logits ({extra}); export without a KV cache "
                                   "(use_cache=False) so that the graph returns only the logits")
        logits = self.values[og.output[0].name]
        shape = logits.type.shape
        if len(shape) != 3 or shape[0] != 1 or shape[1] != "T" or not isinstance(shape[2], int):
            raise UnsupportedError(f"{self.path}: output {og.output[0].name} is {logits.type}; expected the logits "
                                   "of every position, [1, T, vocab]")
        self.g.outputs = [logits]
        self.g.meta = {"family": "onnx", "source": str(self.path.resolve()), "vocab_size": shape[2],
                       "producer": f"{self.model.producer_name} {self.model.producer_version}".strip(),
                       "opset": max((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")),
                                    default=0)}
        return self.g

    def vocab_size(self) -> int:
        """Rows of the table the token ids index (the probe's token ids must stay inside it)."""
        names = {i.name for i in self.onnx_graph.input}
        for n in self.onnx_graph.node:
            if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] in names and n.input[0] in self.inits:
                return int(self.inits[n.input[0]].dims[0])
        return 2

    # -- inputs ---------------------------------------------------------------------------
    def bind_inputs(self) -> None:
        g = self.g
        tokens = g.add_input("tokens", TensorType("i32", ("T",)))
        positions = g.add_input("positions", TensorType("i32", ("T",)))
        rng = np.random.default_rng(0)
        self.probe["tokens"] = tuple(rng.integers(0, self.vocab, size=n).astype(np.int32) for n in PROBE_LENGTHS)
        self.probe["positions"] = tuple(np.arange(n, dtype=np.int32) for n in PROBE_LENGTHS)
        tokens_bound = False
        for inp in sorted(self.onnx_graph.input, key=lambda i: i.name.lower() not in TOKEN_INPUTS):
            if inp.name in self.inits:
                continue
            tt = inp.type.tensor_type
            dtype = ONNX_DTYPES.get(tt.elem_type)
            rank = len(tt.shape.dim)
            lname = inp.name.lower()
            if dtype not in ("i64", "i32") or rank != 2:
                raise UnsupportedError(f"{self.path}: input {inp.name} is {dtype}[rank {rank}]; infeng feeds "
                                       "input_ids / position_ids / attention_mask of shape [1, sequence]")
            batch = tt.shape.dim[0]
            if batch.HasField("dim_value") and batch.dim_value != 1:
                raise UnsupportedError(f"{self.path}: input {inp.name} has batch size {batch.dim_value}; "
                                       "export with batch 1 (infeng batches sequences itself)")
            if lname in POSITION_INPUTS:
                source = positions
            elif lname in MASK_INPUTS:
                source = None
            elif lname in TOKEN_INPUTS or not tokens_bound:
                source, tokens_bound = tokens, True
            else:
                raise UnsupportedError(f"{self.path}: input {inp.name} is not one infeng can feed "
                                       f"(token ids, position ids, attention mask)")
            name = _ir_name(inp.name)
            if source is None:   # no padding inside a sequence: the mask is all ones
                value = self.node("constant_of_shape", [self.node("shape", [tokens], {}, name + ".len")],
                                  {"value": 1, "dtype": dtype}, name + ".flat")
            else:
                value = self.node("cast", [source], {"to": dtype}, name + ".flat")
            self.values[inp.name] = self.node("add_batch", [value], {}, name)

    # -- nodes ----------------------------------------------------------------------------
    def convert(self, node, onnx) -> None:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Constant":
            self.values[node.output[0]] = self.constant(node, attrs, onnx)
            return
        ins = list(node.input)
        while ins and not ins[-1]:
            ins.pop()
        if any(not i for i in ins):
            raise UnsupportedError(f"{self.path}: node {node.name or node.op_type}: an omitted optional input before "
                                   "a given one is not supported")
        inputs = [self.value(i) for i in ins]
        op = "gelu" if node.op_type == "Gelu" else ONNX_PRIMITIVES[node.op_type]
        attrs = self.convert_attrs(node, op, attrs, onnx)
        outs = [o for o in node.output]
        if any(not o for o in outs):
            raise UnsupportedError(f"{self.path}: node {node.name or node.op_type}: omitted outputs are not supported")
        if op == "split_nd" and len(inputs) == 1:
            attrs["num_outputs"] = len(outs)
        if op == "layer_normalization" and len(outs) > 1:
            raise UnsupportedError(f"{self.path}: LayerNormalization with mean/inv-std outputs is not supported")
        results = self.node_multi(op, inputs, attrs, [_ir_name(o) for o in outs])
        for o, v in zip(outs, results):
            self.values[o] = v

    def convert_attrs(self, node, op: str, attrs: dict[str, Any], onnx) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in attrs.items():
            if isinstance(value, bytes):
                value = value.decode()
            elif isinstance(value, onnx.TensorProto):
                arr = onnx.numpy_helper.to_array(value)
                out["dtype"] = ONNX_DTYPES[value.data_type]
                value = arr.reshape(-1)[0].item() if arr.size else 0
            elif not isinstance(value, (int, float, str, list)):
                raise UnsupportedError(f"{self.path}: node {node.name or node.op_type}: attribute {key} of type "
                                       f"{type(value).__name__} is not supported")
            if key == "to":
                value = ONNX_DTYPES[value]
            if key == "axes":           # opset < 13: an attribute; later an input of the same name
                key = "axes_attr"
            out[key] = value
        if op == "matmul" or op == "gemm":
            module = self.module_scope(node)
            if module:
                out["module"] = module
        return out

    @staticmethod
    def module_scope(node) -> str | None:
        """The torch module a node came from (dynamo exports record ``pkg.torch.onnx.name_scopes``)."""
        import ast

        for prop in node.metadata_props:
            if prop.key == "pkg.torch.onnx.name_scopes":
                try:
                    scopes = ast.literal_eval(prop.value)
                except (ValueError, SyntaxError):
                    return None
                return scopes[-2] if len(scopes) >= 2 and scopes[-2] else None
        return None

    def constant(self, node, attrs: dict[str, Any], onnx) -> Value:
        name = _ir_name(node.output[0])
        if "value" in attrs:
            tensor = attrs["value"]
            return self.const_from_array(name, onnx.numpy_helper.to_array(tensor), ONNX_DTYPES[tensor.data_type])
        for key, dtype in (("value_float", "f32"), ("value_floats", "f32"), ("value_int", "i64"), ("value_ints", "i64")):
            if key in attrs:
                return self.const_from_array(name, np.array(attrs[key], dtype=DTYPE_NUMPY[dtype]), dtype)
        raise UnsupportedError(f"{self.path}: Constant {node.output[0]}: attributes {sorted(attrs)} not supported")

    def value(self, onnx_name: str) -> Value:
        if onnx_name in self.values:
            return self.values[onnx_name]
        if onnx_name in self.inits:
            v = self.initializer(self.inits[onnx_name])
            self.values[onnx_name] = v
            return v
        raise ModelFormatError(f"{self.path}: value {onnx_name} is used before it is defined")

    def initializer(self, t) -> Value:
        from onnx import numpy_helper

        dtype = ONNX_DTYPES.get(t.data_type)
        if dtype is None:
            raise UnsupportedError(f"{self.path}: initializer {t.name} has ONNX data type {t.data_type}; "
                                   f"supported: {', '.join(ONNX_DTYPES.values())}")
        shape = tuple(int(d) for d in t.dims)
        name = _ir_name(t.name)
        numel = int(np.prod(shape)) if shape else 1
        external = t.data_location == 1
        if not external and numel <= INLINE_LIMIT and dtype != "bf16":
            return self.const_from_array(name, numpy_helper.to_array(t), dtype)
        if external:
            info = {e.key: e.value for e in t.external_data}
            file = (self.path.parent / info["location"]).resolve()
            offset, length = int(info.get("offset", 0)), info.get("length")
            nbytes = numel * np.dtype(DTYPE_NUMPY.get(dtype, np.uint16)).itemsize
            if not file.is_file():
                raise ModelFormatError(f"{file}: external data of {t.name} not found")
            if length is not None and int(length) != nbytes or offset + nbytes > file.stat().st_size:
                raise ModelFormatError(f"{file}: external data of {t.name} ({list(shape)} {dtype}) does not fit at "
                                       f"offset {offset}")
            weight = Weight(name, TensorType(dtype, shape), file=str(file), offset=offset)
        else:
            array = numpy_helper.to_array(t)
            if dtype == "bf16":
                array = array.view(np.uint16) if array.dtype.itemsize == 2 else array
            weight = Weight(name, TensorType(dtype, shape), array=np.ascontiguousarray(array))
        self.g.add_weight(weight)
        arr = weight.raw()
        if dtype == "bf16":
            raise UnsupportedError(f"{self.path}: bf16 initializer {t.name}: export the model in float32")
        node = self.g.add_node("const", [], [weight], out_types=[weight.type], out_names=[self.g.fresh(name)])
        self.probe[node.output.name] = (arr, arr)
        return node.output

    def const_from_array(self, name: str, arr: np.ndarray, dtype: str) -> Value:
        attrs = {"value": arr.tolist(), "dtype": dtype}
        node = self.g.add_node("const", [], [], attrs, out_types=[TensorType(dtype, arr.shape)],
                               out_names=[self.g.fresh(name)])
        self.probe[node.output.name] = (arr, arr)
        return node.output

    def node(self, op: str, inputs: list[Value], attrs: dict[str, Any], name: str) -> Value:
        return self.node_multi(op, inputs, attrs, [name])[0]

    def node_multi(self, op: str, inputs: list[Value], attrs: dict[str, Any], names: list[str]) -> list[Value]:
        """Evaluate at both probe lengths, declare the result types, append the node."""
        opdef = get_op(op)
        results = []
        for k, length in enumerate(PROBE_LENGTHS):
            ins = [self.probe[v.name][k] for v in inputs]
            step = _ProbeStep(length)
            try:
                results.append(opdef.reference(ins, [], attrs, step))
            except Exception as e:
                raise ModelFormatError(f"{self.path}: evaluating {op} -> {names[0]} at sequence length {length} "
                                       f"failed: {e}") from None
        types = [self.declare(names[i], a, b) for i, (a, b) in enumerate(zip(*results))]
        node = self.g.add_node(op, inputs, [], attrs, out_types=types, out_names=[self.g.fresh(n) for n in names])
        for v, a, b in zip(node.outputs, *results):
            self.probe[v.name] = (a, b)
        return node.outputs

    def declare(self, name: str, a: np.ndarray, b: np.ndarray) -> TensorType:
        dtype = _NUMPY_TO_IR.get(a.dtype)
        if dtype is None:
            raise UnsupportedError(f"{self.path}: {name} has element type {a.dtype}, which infeng does not represent")
        if a.ndim != b.ndim:
            raise UnsupportedError(f"{self.path}: the rank of {name} depends on the sequence length")
        return TensorType(dtype, tuple(symbolic_dim(x, y, name, self.path) for x, y in zip(a.shape, b.shape)))


def symbolic_dim(a: int, b: int, what: str, where: Any = "") -> int | str:
    """The dimension of a value that is ``a`` at the first probe length and ``b`` at the second."""
    p, q = PROBE_LENGTHS
    if a == b:
        return int(a)
    if b - a == q - p:
        k = a - p
        return "T" if k == 0 else f"T{k:+d}"
    raise UnsupportedError(f"{where}: a dimension of {what} is {a} at sequence length {p} and {b} at {q}; only "
                           "constants and the sequence length plus a constant are supported")


class _ProbeStep:
    """What a primitive reference may read from the step: the sequence length (via ``seq_ids``)."""

    def __init__(self, length: int):
        self.seq_ids = np.zeros(length, dtype=np.int32)
        self.logits_rows = np.arange(length)

"""Export an IR graph as an ONNX model, for reading in Netron and checking with ``onnx.checker``.

Ops with an ONNX equivalent of the same semantics become that operator (``linear`` -> Gemm with
transB, ``embedding`` -> Gather, ``layer_norm`` -> LayerNormalization, ``add`` -> Add, ``split``
-> Split, ``gelu`` -> Gelu, primitive ops -> their ONNX operator); transformer ops ONNX has no
operator for (``rms_norm``, ``rope``, ``attention``, ``silu_mul``, ``logits``, ...) become nodes
of the custom domain ``ai.infeng`` with the IR attributes (dicts as JSON strings). Symbolic
dimensions are ONNX dim_params (``T``, ``R``); weight ``@w`` is the initializer named ``@w``. The model documents the graph; it is not meant to
run in an ONNX runtime (the custom ops carry the KV-cache semantics of the IR).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .graph import Graph, Node, Weight
from .ops import ONNX_PRIMITIVES
from .types import TensorType

DOMAIN = "ai.infeng"
OPSET = 20
_ONNX_TYPES = {"f32": 1, "i32": 6, "i64": 7, "bool": 9, "f16": 10, "f64": 11, "bf16": 16}
_PRIMITIVE_TO_ONNX = {v: k for k, v in ONNX_PRIMITIVES.items()}
#: Inline weights above this many bytes in total go to an external data file beside the model.
EXTERNAL_THRESHOLD = 1 << 30


def to_onnx(g: Graph, with_weights: bool = True):
    """The ``onnx.ModelProto`` of ``g``; ``with_weights=False`` declares weights as graph inputs only."""
    from onnx import helper

    nodes, inits, extra_inputs = [], [], []
    for w in g.weights.values():
        if with_weights:
            inits.append(_initializer(w))
        else:
            extra_inputs.append(helper.make_tensor_value_info("@" + w.name, _ONNX_TYPES[w.type.dtype], _dims(w.type)))
    for i, n in enumerate(g.nodes):
        nodes.extend(_node(n, i))
    inputs = [helper.make_tensor_value_info(v.name, _ONNX_TYPES[v.type.dtype], _dims(v.type)) for v in g.inputs]
    outputs = [helper.make_tensor_value_info(v.name, _ONNX_TYPES[v.type.dtype], _dims(v.type)) for v in g.outputs]
    out_names = {v.name for v in g.outputs}
    value_info = [helper.make_tensor_value_info(v.name, _ONNX_TYPES[v.type.dtype], _dims(v.type))
                  for n in g.nodes for v in n.outputs if v.name not in out_names]
    graph = helper.make_graph(nodes, g.name, inputs + extra_inputs, outputs, initializer=inits, value_info=value_info,
                              doc_string=json.dumps(g.meta))
    model = helper.make_model(graph, producer_name="infeng", opset_imports=[helper.make_opsetid("", OPSET),
                                                                           helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = min(model.ir_version, 10)
    return model


def save_onnx(g: Graph, path: str | Path) -> Path:
    """Write ``g`` to ``path`` (weights external when large) and check it with ``onnx.checker``."""
    import onnx

    path = Path(path)
    model = to_onnx(g)
    external = sum(w.type.nbytes() for w in g.weights.values()) > EXTERNAL_THRESHOLD
    onnx.save_model(model, str(path), save_as_external_data=external, location=path.name + ".data")
    onnx.checker.check_model(str(path))
    return path


def _dims(t: TensorType) -> list[Any]:
    return [d if isinstance(d, int) else str(d) for d in t.shape]


def _initializer(w: Weight):
    from onnx import numpy_helper

    data = w.numpy_f32() if w.type.dtype in ("f16", "bf16", "f32") else np.asarray(w.raw())
    return numpy_helper.from_array(np.ascontiguousarray(data), name="@" + w.name)


def _attr(value: Any) -> Any:
    """IR attribute -> something onnx.helper.make_attribute accepts."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (dict, type(None))) or (isinstance(value, list) and
                                                 any(isinstance(x, (list, dict, str, type(None))) for x in value)):
        return json.dumps(value)
    if isinstance(value, list) and any(isinstance(x, float) for x in value):
        return [float(x) for x in value]
    return value


def _node(n: Node, index: int) -> list:
    from onnx import helper, numpy_helper

    ins = [v.name for v in n.inputs] + ["@" + w.name for w in n.weights]
    outs = [v.name for v in n.outputs]
    name = f"n{index}_{n.op}"
    a = n.attrs
    if n.op == "linear":
        return [helper.make_node("Gemm", ins, outs, name=name, transB=1)]
    if n.op == "embedding":
        return [helper.make_node("Gather", ["@" + n.weights[0].name, n.inputs[0].name], outs, name=name, axis=0)]
    if n.op == "layer_norm":
        return [helper.make_node("LayerNormalization", ins, outs, name=name, axis=-1, epsilon=float(a["eps"]))]
    if n.op == "add":
        return [helper.make_node("Add", ins, outs, name=name)]
    if n.op == "gelu":
        return [helper.make_node("Gelu", ins, outs, name=name, approximate=a["approximate"])]
    if n.op == "split":
        sizes = helper.make_node("Constant", [], [outs[0] + ".sizes"], name=name + "_sizes",
                                 value=numpy_helper.from_array(np.array(a["sizes"], np.int64)))
        return [sizes, helper.make_node("Split", ins + [outs[0] + ".sizes"], outs, name=name, axis=-1)]
    if n.op == "const" and "value" in a and not _symbolic(a["value"]):
        from .ops import const_array

        return [helper.make_node("Constant", [], outs, name=name,
                                 value=numpy_helper.from_array(const_array(a)))]
    if n.op == "const" and n.weights:
        return [helper.make_node("Identity", ["@" + n.weights[0].name], outs, name=name)]
    if n.op in _PRIMITIVE_TO_ONNX:
        attrs = {("axes" if k == "axes_attr" else k): _onnx_attr(k, v) for k, v in a.items() if k not in ("module",)}
        if n.op == "constant_of_shape":
            attrs = {"value": numpy_helper.from_array(np.array([a.get("value", 0)], dtype=_np(a.get("dtype", "f32"))))}
        return [helper.make_node(_PRIMITIVE_TO_ONNX[n.op], ins, outs, name=name, **attrs)]
    return [helper.make_node(n.op, ins, outs, name=name, domain=DOMAIN, **{k: _attr(v) for k, v in a.items()})]


def _symbolic(value: Any) -> bool:
    if isinstance(value, list):
        return any(_symbolic(v) for v in value)
    return isinstance(value, str)


def _np(dtype: str):
    from .ops import DTYPE_NUMPY

    return DTYPE_NUMPY[dtype]


def _onnx_attr(key: str, value: Any) -> Any:
    if key == "to":
        return _ONNX_TYPES[value]
    return _attr(value)

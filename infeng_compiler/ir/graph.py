"""The IR graph: SSA values, nodes, lazily loaded weights.

A ``Graph`` holds named inputs, weight constants, ordered nodes and outputs. Storage is plain
lists and dicts; analyses that need a graph algorithm build a networkx view (``to_networkx``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import networkx as nx
import numpy as np

from infeng_common.errors import IRError, ModelFormatError

from . import storage
from .memory import MemoryPlan
from .types import DTYPES, TensorType, bf16_to_f32, f32_to_bf16


@dataclass(eq=False)
class Value:
    """An SSA value: produced by one node (or a graph input), read by any number of nodes."""

    name: str
    type: TensorType

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Weight:
    """A constant tensor. ``type`` is the logical (possibly transposed) storage type.

    A weight read from a file knows ``file`` and byte ``offset`` and is memory-mapped on first use;
    a weight made by a pass holds its ``array``, or only its ``quant`` (stacked quantized weights). ``transposed`` means the file stores the
    transpose of the logical shape (GPT-2's Conv1D keeps weights as [in, out]).
    """

    name: str
    type: TensorType
    file: str | None = None
    offset: int = 0
    transposed: bool = False
    array: np.ndarray | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    #: for a quantized ``format``: the codes and scales the quantize pass chose
    #: (``quant.formats.QuantizedTensor``); None: round ``raw()`` on first use (``quantized()``)
    quant: Any = field(default=None, repr=False)

    def raw(self) -> np.ndarray:
        """The stored elements in their storage dtype (bf16 as uint16), logical shape."""
        if self.array is not None:
            return self.array
        if self.file is None:
            raise IRError(f"weight @{self.name} has no data (parsed from text without a source)")
        np_dtype = DTYPES[self.type.dtype][0]
        stored_shape = tuple(reversed(self.type.shape)) if self.transposed else self.type.shape
        try:
            data = np.memmap(self.file, dtype=np_dtype, mode="r", offset=self.offset, shape=stored_shape)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{self.file}: cannot map tensor {self.name}: {e}") from None
        return data.T if self.transposed else data

    @property
    def format(self) -> str:
        """The storage format codegen writes: ``attrs["format"]`` when a pass set one, else the source dtype."""
        return self.attrs.get("format", self.type.dtype)

    def quantized(self):
        """The ``QuantizedTensor`` of a weight in a quantized format (registered by ``quant/``)."""
        if self.quant is None or self.quant.format != self.format:
            raw = self.raw()
            f32 = bf16_to_f32(np.asarray(raw)) if self.type.dtype == "bf16" else np.asarray(raw, dtype=np.float32)
            self.quant = storage.weights().quantize(f32, self.format)
        return self.quant

    def stored(self) -> np.ndarray:
        """The weight in its storage format: float32, float16, bf16 bits as uint16, or the packed
        bytes (uint8) of a quantized format (contiguous)."""
        if storage.weights().is_quantized(self.format):
            return self.quantized().pack()
        raw, src, fmt = self.raw(), self.type.dtype, self.format
        if fmt == src:
            return np.ascontiguousarray(raw)
        f32 = bf16_to_f32(np.asarray(raw)) if src == "bf16" else np.asarray(raw, dtype=np.float32)
        if fmt == "f32":
            return np.ascontiguousarray(f32)
        if fmt == "f16":
            return np.ascontiguousarray(f32.astype(np.float16))
        if fmt == "bf16":
            return f32_to_bf16(f32)
        raise IRError(f"weight @{self.name}: unknown storage format {fmt!r}")

    def numpy_f32(self) -> np.ndarray:
        """The weight as float32, rounded through its storage format (a copy when converting)."""
        if storage.weights().is_quantized(self.format):
            return self.quantized().dequantize()
        data = self.stored()
        if self.format == "bf16":
            return bf16_to_f32(data)
        return np.ascontiguousarray(data, dtype=np.float32)

    def signature(self) -> tuple:
        return (self.name, self.type, self.file, self.offset, self.transposed,
                tuple(sorted(self.attrs.items(), key=lambda kv: kv[0])))


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    weights: list[Weight]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise IRError(f"{self.op} has {len(self.outputs)} outputs")
        return self.outputs[0]

    def signature(self) -> tuple:
        return (self.op, tuple(v.name for v in self.inputs), tuple(w.name for w in self.weights),
                tuple((v.name, v.type) for v in self.outputs), _freeze(self.attrs))


def _freeze(obj: Any) -> Any:
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


class Graph:
    """An ordered SSA graph with weights and free-form metadata (``meta``: the model config), and
    the memory plan ``plan-memory`` records (``memory``, ``ir/memory.py``; None before it runs)."""

    def __init__(self, name: str = "main", meta: dict[str, Any] | None = None):
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})
        self.inputs: list[Value] = []
        self.weights: dict[str, Weight] = {}
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.memory: MemoryPlan | None = None
        self._names: set[str] = set()

    # -- building -------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A value name not used yet, ``base`` itself when free."""
        name, i = base, 1
        while name in self._names:
            name = f"{base}.{i}"
            i += 1
        return name

    def add_input(self, name: str, type: TensorType) -> Value:
        value = Value(self._claim(name), type)
        self.inputs.append(value)
        return value

    def add_weight(self, weight: Weight) -> Weight:
        if weight.name in self.weights:
            raise IRError(f"weight @{weight.name} declared twice")
        self.weights[weight.name] = weight
        return weight

    def add_node(self, op: str, inputs: list[Value], weights: list[Weight] | None = None,
                 attrs: dict[str, Any] | None = None, name: str | None = None,
                 out_types: list[TensorType] | None = None, out_names: list[str] | None = None) -> Node:
        """Append a node; output types come from the op's shape rule unless given."""
        from .ops import infer_types

        weights = weights or []
        attrs = dict(attrs or {})
        if out_types is None:
            out_types = infer_types(op, [v.type for v in inputs], [w.type for w in weights], attrs)
            if out_types is None:
                raise IRError(f"{op}: the result type depends on operand values; pass out_types")
        if out_names is None:
            base = name or op
            out_names = [base] if len(out_types) == 1 else [f"{base}.{i}" for i in range(len(out_types))]
        outputs = [Value(self._claim(n), t) for n, t in zip(out_names, out_types)]
        node = Node(op, list(inputs), list(weights), outputs, attrs)
        self.nodes.append(node)
        return node

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise IRError(f"value %{name} defined twice")
        self._names.add(name)
        return name

    def rebuild_names(self) -> None:
        """Recompute the set of used names after a pass edited ``nodes`` directly."""
        self._names = {v.name for v in self.inputs}
        for n in self.nodes:
            self._names.update(v.name for v in n.outputs)

    # -- queries --------------------------------------------------------------------------
    def producers(self) -> dict[str, Node]:
        return {v.name: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                users.setdefault(v.name, []).append(n)
        return users

    def find(self, op: str) -> Iterator[Node]:
        return (n for n in self.nodes if n.op == op)

    def replace_uses(self, old: Value, new: Value) -> None:
        for n in self.nodes:
            n.inputs = [new if v is old else v for v in n.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def weight_bytes(self) -> int:
        used = {w.name for n in self.nodes for w in n.weights}
        return sum(self.weights[name].type.nbytes() for name in used)

    def to_networkx(self) -> nx.DiGraph:
        """Dataflow graph: one vertex per node index, weights and inputs as source vertices."""
        g = nx.DiGraph()
        producer = {}
        for v in self.inputs:
            g.add_node(f"%{v.name}", kind="input", label=f"%{v.name}\n{v.type}")
            producer[v.name] = f"%{v.name}"
        for i, n in enumerate(self.nodes):
            key = f"n{i}"
            g.add_node(key, kind="op", label=f"{n.op}\n{', '.join(str(v.type) for v in n.outputs)}")
            for v in n.inputs:
                g.add_edge(producer[v.name], key, label=v.name)
            for w in n.weights:
                wkey = f"@{w.name}"
                g.add_node(wkey, kind="weight", label=f"@{w.name}\n{w.type}")
                g.add_edge(wkey, key)
            for v in n.outputs:
                producer[v.name] = key
        return g

    # -- equality (structural, used by the round-trip tests) -----------------------------
    def signature(self) -> tuple:
        return (self.name, _freeze(self.meta), tuple((v.name, v.type) for v in self.inputs),
                tuple(w.signature() for w in self.weights.values()),
                tuple(n.signature() for n in self.nodes), tuple(v.name for v in self.outputs),
                self.memory.signature() if self.memory is not None else None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.signature() == other.signature()

    def __str__(self) -> str:
        from .printer import print_graph

        return print_graph(self)

    def map_weights(self, fn: Callable[[Weight], Weight]) -> None:
        """Replace every weight by ``fn(weight)``, keeping node references consistent."""
        new = {name: fn(w) for name, w in self.weights.items()}
        self.weights = {w.name: w for w in new.values()}
        for n in self.nodes:
            n.weights = [new[w.name] for w in n.weights]

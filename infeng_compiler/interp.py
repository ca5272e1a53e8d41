"""The numpy reference interpreter: the golden model every pass and kernel is checked against.

``Interpreter.step`` runs one forward step over a batch of tokens from any number of sequences,
each at its own positions (prefill chunks and decode tokens mixed), appending to a per-sequence
KV cache, and returns logits for the rows asked for.

It is the one loop that walks a graph: ``Interpreter.run`` evaluates any list of nodes (the whole
graph, a prefix of it, or nodes not yet placed in it) over an environment of named arrays, and an
observer (``NodeObserver``) sees every node's inputs, weights and results as they are computed.
Calibration (``quant/calibrate.py``) collects its statistics through the observer; the ONNX
passes (``passes/rewrite.py``: ``fold-shapes``, the ``raise`` check) evaluate through ``run``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from infeng_common.errors import InfengError

from .ir import Graph, Node, Weight
from .ir.ops import Reference
from .ir.ops import get as get_op

#: ``observer(node, inputs, weights, outputs)``: called after each node runs, with the arrays it read
#: and the arrays it produced (in the order of ``node.inputs``, ``node.weights``, ``node.outputs``).
NodeObserver = Callable[[Node, list[np.ndarray], list[np.ndarray], list[np.ndarray]], None]


class KVStore:
    """Rows per (layer, sequence), indexed by position; grows on demand.

    Each write stores named arrays of rows: ``k`` and ``v`` always (what the cache holds, already
    rounded through its format), plus any extra copy a KV format keeps (``recent_k``/``recent_v``:
    the f16 window of a quantized cache, docs/kv-cache.md)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def write(self, layer: int, seq: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray,
              **extra: np.ndarray) -> None:
        stores = self._rows.setdefault((layer, seq), {})
        need = int(positions.max()) + 1
        for name, new in {"k": k, "v": v, **extra}.items():
            old = stores.get(name)
            if old is None or old.shape[0] < need:
                cap = max(need, 2 * (old.shape[0] if old is not None else 16))
                grown = np.zeros((cap,) + new.shape[1:], dtype=np.float32)
                if old is not None:
                    grown[: old.shape[0]] = old
                stores[name] = old = grown
            old[positions] = new

    def read(self, layer: int, seq: int, length: int, *names: str) -> tuple[np.ndarray, ...]:
        """The first ``length`` rows of ``names`` (default ``k``, ``v``)."""
        stores = self._rows[(layer, seq)]
        return tuple(stores[name][:length] for name in (names or ("k", "v")))

    def drop(self, seq: int) -> None:
        for key in [k for k in self._rows if k[1] == seq]:
            del self._rows[key]


@dataclass
class Step:
    """What one forward step sees besides the graph inputs."""

    seq_ids: np.ndarray          # [T] sequence of each token
    logits_rows: np.ndarray      # [R] token rows whose logits are returned
    kv: KVStore = field(default_factory=KVStore)
    lora: dict = field(default_factory=dict)     # adapter slot -> {base weight name: LoraModule}


def weight_value(w: Weight) -> np.ndarray:
    """What a node reads of weight ``w``: float weights as float32, rounded through their storage
    format (f16, bf16, a quantized format: what the compiled model multiplies); integer, boolean and
    f64 constants (an ONNX import's primitive graph) as stored."""
    if w.type.dtype in ("f32", "f16", "bf16") or "format" in w.attrs:
        return w.numpy_f32()
    return np.asarray(w.raw())


class Interpreter:
    """Runs a Graph with numpy. Each weight is read once (``weight_value``) and kept.

    ``references``: op name -> a reference used instead of the registry's for that op (calibration
    runs attention in float32 over whole sequences, ``quant/calibrate.py``)."""

    def __init__(self, graph: Graph, observer: NodeObserver | None = None,
                 references: dict[str, Reference] | None = None):
        self.graph = graph
        self.observer = observer
        self.references = references or {}
        self.kv = KVStore()
        self._weights: dict[str, tuple[Weight, np.ndarray]] = {}
        self.lora: dict[int, dict] = {}          # adapter slot -> {base weight name: LoraModule}

    def load_adapter(self, slot: int, adapter) -> None:
        """Put a ``frontends.peft.LoraAdapter`` in ``slot`` (graphs with ``lora_linear`` nodes)."""
        self.lora[slot] = dict(adapter.modules)

    def unload_adapter(self, slot: int) -> None:
        self.lora.pop(slot, None)

    def weight(self, w: Weight) -> np.ndarray:
        """``weight_value(w)``, computed once per weight."""
        kept = self._weights.get(w.name)
        if kept is None or kept[0] is not w:
            kept = self._weights[w.name] = (w, weight_value(w))
        return kept[1]

    def run(self, env: dict[str, np.ndarray], step: Step, nodes: Iterable[Node] | None = None) -> dict[str, np.ndarray]:
        """Evaluate ``nodes`` (default: the graph's), in order, over ``env`` (value name -> array, the
        inputs of the first node at least); each node's results are added to ``env``, which is
        returned. The observer, if any, sees every node."""
        for node in self.graph.nodes if nodes is None else nodes:
            ins = [env[v.name] for v in node.inputs]
            ws = [self.weight(w) for w in node.weights]
            reference = self.references.get(node.op) or get_op(node.op).reference
            outs = reference(ins, ws, node.attrs, step)
            for value, array in zip(node.outputs, outs):
                env[value.name] = array
            if self.observer is not None:
                self.observer(node, ins, ws, list(outs))
        return env

    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logits_rows: np.ndarray | None = None, adapter_slots: np.ndarray | None = None) -> np.ndarray:
        """Logits [R, vocab] for ``logits_rows`` (default: every row); ``adapter_slots`` [T]: the
        LoRA slot of each token, -1 for the base model."""
        tokens = np.asarray(tokens, dtype=np.int32)
        positions = np.asarray(positions, dtype=np.int32)
        seq_ids = np.asarray(seq_ids, dtype=np.int32)
        if not (tokens.shape == positions.shape == seq_ids.shape and tokens.ndim == 1):
            raise InfengError("tokens, positions and seq_ids must be 1-D arrays of one length")
        rows = np.arange(len(tokens)) if logits_rows is None else np.asarray(logits_rows, dtype=np.int64)
        slots = np.full(len(tokens), -1, np.int32) if adapter_slots is None else np.asarray(adapter_slots, np.int32)
        env: dict[str, np.ndarray] = {"tokens": tokens, "positions": positions, "adapter_slots": slots}
        for v in self.graph.inputs:
            if v.name not in env:
                raise InfengError(f"graph input %{v.name} is not provided by the interpreter")
        self.run(env, Step(seq_ids, rows, self.kv, self.lora))
        return env[self.graph.outputs[0].name]

    def free(self, seq: int) -> None:
        """Forget the KV cache of one sequence."""
        self.kv.drop(seq)

"""The reference interpreter behind the engine surface that ``EngineLoop`` drives: ``forward`` over
a block allocator's sequence slots (each slot is the interpreter's KV sequence), so ``infeng
generate`` runs through the same engine loop, scheduler, sampling and output processor
(``detokenize.ChoiceText``) as a compiled artifact, and a test can serve the golden model the same
way. The prefix cache stays off: the interpreter's KV is per sequence, never shared. A graph with
``lora_linear`` nodes (the ``lora-slots`` pass) serves adapters through the runtime's
``AdapterManager``, whose slot writes become the interpreter's LoRA modules."""
from __future__ import annotations

import numpy as np

from infeng_common.peft import LoraModule
from infeng_common.tokenizer import Tokenizer
from infeng_runtime.adapters import AdapterManager
from infeng_runtime.kv_cache import BlockAllocator

from .interp import Interpreter

#: Token rows of one interpreter step; the scheduler cuts longer prefills into chunks of it.
MAX_TOKENS = 512
#: Positions per KV block (the allocator's bookkeeping unit; the interpreter stores rows).
BLOCK_SIZE = 16
DEFAULT_CONTEXT = 2048


class InterpreterEngine:
    """An ``Interpreter`` with the attributes and ``forward`` of ``infeng_runtime.engine.Engine``
    that the engine loop uses, and its adapter slots (the graph's ``lora_linear`` sites)."""

    def __init__(self, interpreter: Interpreter, tokenizer: Tokenizer, *, max_seqs: int = 1,
                 max_context: int | None = None):
        graph = interpreter.graph
        self.interpreter, self.tokenizer = interpreter, tokenizer
        self.path = graph.name
        self.vocab_size = int(graph.outputs[0].type.shape[-1])
        model_context = graph.meta.get("max_position_embeddings")
        self.max_context = int(max_context or (model_context if isinstance(model_context, int) and model_context > 0
                                               else DEFAULT_CONTEXT))
        self.max_tokens = MAX_TOKENS
        self.kv = BlockAllocator(max_seqs * -(-self.max_context // BLOCK_SIZE), BLOCK_SIZE, max_seqs, self.max_context)
        lora = [n for n in graph.nodes if n.op == "lora_linear"]
        self.sites = [{"site": n.attrs["site"], "target": n.attrs["target"], "in": n.weights[0].type.shape[1],
                       "out": n.weights[0].type.shape[0]} for n in lora]
        slots, rank = (lora[0].attrs["max_adapters"], lora[0].attrs["max_rank"]) if lora else (0, 0)
        self.adapters = AdapterManager(self.sites, slots, rank, graph.name, write=self._write_slot)
        self.manifest = {"name": graph.name, "meta": dict(graph.meta)}
        self.kv_bytes_touched = 0

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                adapter_slots: np.ndarray | None = None) -> np.ndarray:
        """Logits [len(rows), vocab] of one step; ``slots``: each token's sequence slot."""
        return self.interpreter.step(tokens, positions, slots, rows, adapter_slots)

    def _write_slot(self, slot: int, site: int, rank: int, scale: float, a: np.ndarray | None,
                    b: np.ndarray | None) -> None:
        """The adapter manager's write of one site of one slot (rank 0: cleared)."""
        target = next(s["target"] for s in self.sites if s["site"] == site)
        modules = self.interpreter.lora.setdefault(slot, {})
        if rank == 0:
            modules.pop(target, None)
        else:
            modules[target] = LoraModule(target, a, b, scale)

    def close(self) -> None:
        """Nothing to release (the interpreter's KV goes with it)."""

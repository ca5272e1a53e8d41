"""PEFT LoRA adapters against an IR graph: the shapes of the graph's linear layers are what an
adapter may target; reading and checking the adapter is ``infeng_common.peft`` (shared with the
runtime, which checks against the shapes an artifact records)."""
from __future__ import annotations

from pathlib import Path

from infeng_common.peft import PEFT_PREFIX, AdapterMismatchError, LoraAdapter, LoraModule, read_adapter

from ..ir import Graph

__all__ = ["PEFT_PREFIX", "AdapterMismatchError", "LoraAdapter", "LoraModule", "linear_shapes", "load_adapter"]


def linear_shapes(graph: Graph) -> dict[str, tuple[int, int]]:
    """[out, in] of every linear layer's weight, by weight name: what an adapter may target."""
    return {n.weights[0].name: tuple(n.weights[0].type.shape) for n in graph.nodes if n.op in ("linear", "lora_linear")}


def load_adapter(path: str | Path, graph: Graph, name: str | None = None) -> LoraAdapter:
    """Read the PEFT adapter at ``path`` and check it against ``graph``."""
    return read_adapter(path, linear_shapes(graph), name, base_name=graph.name)

"""The pass table: every pass by name, the class that builds it from its pipeline arguments, and the
phase of the pipeline it belongs to. A pass is known because it is listed here (no registration
by import side effect); ``passes/pipeline.py`` orders the phases.

Phases, in pipeline order (docs/ir.md):

- ``import``: the ONNX frontend's raising of primitive ops (``fold-shapes``, ``raise``, ``dce``);
- ``model``: rewrites of the model itself (LoRA merged into weights or given adapter slots);
- ``storage``: how values are stored: the KV cache format, weight dtypes, quantized weights and
  the activations integer weights read;
- ``fusion``: ops merged for the kernels (``fuse-linears``);
- ``memory``: the memory plan lowering reads (``plan-memory``: the arena and ``weights.bin``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .act_precision import ActPrecision
from .cast_weights import CastWeights
from .context import Pass
from .dce import DeadCodeElimination
from .experts_act import ExpertsAct
from .fold_shapes import FoldShapes
from .fuse_linears import FuseLinears
from .kv_cache import FhtKV, KVFormat
from .lora_slots import LoraSlots
from .merge_lora import MergeLora
from .plan_memory import PlanMemory
from .quantize import Quantize
from .raise_ops import Raise

#: The phases of a pipeline, in order.
PHASES = ("import", "model", "storage", "fusion", "memory")


@dataclass(frozen=True)
class PassInfo:
    factory: Callable[..., Pass]       # takes the positional arguments of the pipeline entry
    phase: str


PASS_TABLE: dict[str, PassInfo] = {
    "fold-shapes": PassInfo(FoldShapes, "import"),
    "raise": PassInfo(Raise, "import"),
    "dce": PassInfo(DeadCodeElimination, "import"),
    "merge-lora": PassInfo(MergeLora, "model"),
    "lora-slots": PassInfo(LoraSlots, "model"),
    "fht-kv": PassInfo(FhtKV, "storage"),
    "kv-format": PassInfo(KVFormat, "storage"),
    "cast-weights": PassInfo(CastWeights, "storage"),
    "quantize": PassInfo(Quantize, "storage"),
    "act-precision": PassInfo(ActPrecision, "storage"),
    "experts-act": PassInfo(ExpertsAct, "storage"),
    "fuse-linears": PassInfo(FuseLinears, "fusion"),
    "plan-memory": PassInfo(PlanMemory, "memory"),
}

#: pass name -> factory taking the positional arguments of the pipeline entry.
PASSES: dict[str, Callable[..., Pass]] = {name: info.factory for name, info in PASS_TABLE.items()}

"""What a pass may read besides the graph and its arguments, and what passes report back
(``PassContext``); the ``Pass`` protocol every pass class follows."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from infeng_common.errors import InfengError
from infeng_common.peft import LoraAdapter

from ..ir import Graph

if TYPE_CHECKING:
    from .quantize import QuantReport


class CalibrationTokenizer(Protocol):
    """What calibration needs of a tokenizer (``infeng_common.tokenizer.Tokenizer`` has it)."""

    bos_token_id: int | None

    def encode(self, text: str, add_bos: bool | None = ...) -> list[int]: ...


@dataclass
class PassContext:
    """What a pass may read besides the graph and its arguments, and what passes report back."""

    # inputs
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)   # name -> adapter (merge-lora)
    tokenizer: CalibrationTokenizer | None = None     # encodes calibration text; None: built from model_dir
    model_dir: Path | None = None                     # the model's tokenizer files
    progress: Callable[[int, int], None] | None = None   # (done, total) of the running pass's step
                                                      # (calibration chunks, tensors searched)
    stage: Callable[[str], None] | None = None        # names the running pass's step ("quantize: search")
    search_cache: Path | None = None                  # quantize: search results by weight hash (None: none)
    # reports
    quant_report: QuantReport | None = None           # quantize: formats, bytes, AWQ scales
    calib_tokens: int = 0                             # quantize: calibration tokens run
    kv_calib_tokens: int = 0                          # kv-format: calibration tokens run for K centring

    def calibration_tokenizer(self, graph: Graph, where: str) -> CalibrationTokenizer:
        """The tokenizer a pass calibrates with: ``tokenizer``, else the one in ``model_dir``."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.model_dir is None:
            raise InfengError(f"{where}: calibration needs the model's tokenizer; run it from infeng compile/eval "
                              "(PassContext.model_dir or PassContext.tokenizer)")
        from infeng_common.tokenizer import Tokenizer

        return Tokenizer(Path(self.model_dir), graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))


class Pass(Protocol):
    name: str
    tolerance: float          # max relative change of the logits the pass may introduce

    def run(self, graph: Graph, ctx: PassContext) -> bool: ...

"""``CompileOptions``: what ``infeng compile`` (and every command that compiles: ``ir``, ``explore``,
``serve``, ``serve-ray``, ``chat``, ``run-batch``) compiles with, each option declared once with its
flag, help, range and choices (``infeng_common.options``); the command line's parameters are
generated from these declarations. A light module: the command line imports it at start."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infeng_common.errors import InfengError
from infeng_common.options import check_ranges, option

if TYPE_CHECKING:
    from .ir import Graph

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_CALIB_TOKENS", "DEFAULT_MAX_TOKENS", "CompileOptions"]

DEFAULT_MAX_TOKENS = 256
DEFAULT_BLOCK_SIZE = 16
#: tokens ``--quant ... --calib`` calibrates on unless ``--calib-tokens`` says otherwise (0: every token
#: of the text): no smaller budget measured equals the whole text's quality on all three models of
#: docs/performance.md, *Calibration token budget* (2048 and 4096 lose on the smollm135 shape)
DEFAULT_CALIB_TOKENS = 0


@dataclass
class CompileOptions:
    target: str = option("native", flag="--target",
                         help="native (the best this CPU runs), scalar, avx2, avx2-vnni, avx512, avx512-vnni, "
                              "avx512-bf16, amx (tiles for many-row steps), amx-emu (the amx kernels, tile "
                              "instructions emulated in C: tests only)")
    dtype: str | None = option(None, flag="--dtype", choices=("f32", "f16", "bf16"),
                               help="weight storage for matrices (default f32; given, it also widens a GGUF's "
                                    "Q8_0/Q4_0/Q4_1 matrices, which are kept exact otherwise)")
    max_tokens: int = option(DEFAULT_MAX_TOKENS, flag="--max-tokens", low=1, help="most token rows per forward call")
    block_size: int = DEFAULT_BLOCK_SIZE
    passes: str | None = option(None, flag="--passes", help="explicit pass pipeline")
    dump_ir: Path | None = option(None, flag="--dump-ir", help="write NN-PASS.ir here, after each pass")
    tokenizer: Path | None = option(None, flag="--tokenizer", help="tokenizer/config dir (an ONNX model has none)")
    profile: bool = option(False, flag="--profile", help="time every IR node (see infeng bench --profile)")
    lora: dict[str, Path] = option(flag="--lora", metavar="NAME=DIR", help="a PEFT LoRA adapter (repeatable)",
                                   default_factory=dict)
    merge: list[str] = option(flag="--merge", metavar="NAME", help="fold adapter NAME into the weights",
                              default_factory=list)
    max_adapters: int = option(0, flag="--max-adapters", low=0,
                               help="LoRA slots for adapters loaded at run time (0: none, unless unmerged --lora "
                                    "adapters need them)")
    max_rank: int = option(0, flag="--max-rank", low=0,
                           help="max LoRA rank per slot (0: 16, or the largest --lora adapter's rank above it)")
    lora_targets: str = option("", flag="--lora-targets",
                               help="modules with slots, e.g. q_proj+v_proj (default: all)")
    quant: str | None = option(None, flag="--quant", choices=("int8", "int4", "fp8"),
                               help="quantize the weights: int8, int4 or fp8")
    quant_policy: Path | None = option(None, flag="--quant-policy",
                                       help="per-tensor formats (JSON, see docs/quantization.md)")
    calib: Path | None = option(None, flag="--calib",
                                help="calibration text (--quant: AWQ + clipping; int8/int4 --kv: K centring)")
    calib_max_bytes: int | None = option(None, flag="--calib-max-bytes", low=1,
                                         help="use only the first N bytes of --calib")
    calib_tokens: int = option(DEFAULT_CALIB_TOKENS, flag="--calib-tokens", low=0,
                               help="calibrate --quant on at most N tokens: whole chunks spread evenly over "
                                    "the text (0: all of it)")
    kv: str = option("f32", flag="--kv", choices=("f32", "f16", "int8", "int4", "fht-int8", "fht-int4"),
                     help="KV cache format (fht-: Hadamard-rotated; docs/kv-cache.md)")
    kv_window: int = option(0, flag="--kv-window", low=0,
                            help="keep each sequence's last N tokens in f16 (int8/int4 --kv)")
    act_precision: str | None = option(None, flag="--act-precision", metavar="MODE", choices=("int8", "f32", "auto"),
                                       help="activations that integer (4/8-bit) weights multiply: int8 (the "
                                            "default; every step), f32 (every step: as transformers on the "
                                            "dequantized file), auto (f32 for steps of few token rows, int8 for "
                                            "prefill); docs/quantization.md")

    def check(self) -> None:
        """InfengError (one line, naming the flag) for a value out of range or a --merge of no --lora."""
        check_ranges(self)
        unknown = [m for m in self.merge if m not in self.lora]
        if unknown:
            raise InfengError(f"--merge {unknown[0]}: no adapter of that name; give it with --lora {unknown[0]}=DIR")

    def pipeline(self, adapters: dict | None = None, graph: Graph | None = None) -> list[tuple[str, list[str]]]:
        """The pass pipeline these options ask for, its phases flattened (``passes/pipeline.py``)."""
        from .passes.pipeline import build_pipeline

        return [entry for phase in build_pipeline(self, adapters, graph) for entry in phase.entries]

"""MXFP4 weights from a checkpoint: a ``*_blocks`` / ``*_scales`` pair (GPT-OSS's experts) as one
packed weight, memory-mapped and kept byte for byte (``quant/formats.py``: ``MXFP4Format``); marked
``prequantized``, so ``cast-weights`` and ``quantize`` keep it (an explicit ``--dtype`` widens it)."""
from __future__ import annotations

import numpy as np

from infeng_common.errors import ModelFormatError
from infeng_common.safetensors import TensorEntry

from ..ir import Weight
from ..ir.types import TensorType
from ..quant.formats import MXFP4_BLOCK, MXFP4_BLOCK_BYTES, mxfp4_tensor


def mxfp4_weight(name: str, blocks: TensorEntry, scales: TensorEntry) -> Weight:
    """The weight ``name`` [..., N, K] in format ``mxfp4`` from ``blocks`` uint8 [..., N, K/32, 16]
    and ``scales`` uint8 [..., N, K/32] (their layout is already [out, in]: no transpose)."""
    for entry in (blocks, scales):
        if entry.dtype != "u8":
            raise ModelFormatError(f"{entry.file}: tensor {entry.name} is {entry.dtype}, MXFP4 blocks and scales are U8")
    if len(blocks.shape) < 3 or blocks.shape[-1] != MXFP4_BLOCK_BYTES or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelFormatError(f"{blocks.file}: MXFP4 tensors {blocks.name} {list(blocks.shape)} and {scales.name} "
                               f"{list(scales.shape)} are not [..., N, K/32, {MXFP4_BLOCK_BYTES}] and [..., N, K/32]")
    try:
        codes = np.memmap(blocks.file, dtype=np.uint8, mode="r", offset=blocks.offset, shape=tuple(blocks.shape))
        exps = np.memmap(scales.file, dtype=np.uint8, mode="r", offset=scales.offset, shape=tuple(scales.shape))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{blocks.file}: cannot map MXFP4 tensor {blocks.name}: {e}") from None
    quant = mxfp4_tensor(codes, exps)
    shape = (*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)
    return Weight(name, TensorType("f32", shape), attrs={"format": "mxfp4", "prequantized": "checkpoint MXFP4"}, quant=quant)

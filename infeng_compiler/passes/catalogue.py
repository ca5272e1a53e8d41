"""Imports every pass module so that each registers itself with the pass manager (``dce``,
``fold-shapes`` and ``raise`` serve the ONNX import; the others the compile pipeline)."""
from . import (  # noqa: F401
    act_precision,
    cast_weights,
    dce,
    experts_act,
    fold_shapes,
    fuse_linears,
    kv_cache,
    lora_slots,
    merge_lora,
    quantize,
    raise_ops,
)

"""Imports every pass module so that each registers itself with the pass manager."""
from . import cast_weights  # noqa: F401
from . import merge_lora  # noqa: F401
from . import lora_slots  # noqa: F401
from . import kv_cache  # noqa: F401
from . import dce, fold_shapes, raise_ops  # noqa: F401  (ONNX import)
from . import quantize  # noqa: F401
from . import fuse_linears  # noqa: F401

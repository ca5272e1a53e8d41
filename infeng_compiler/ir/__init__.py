"""The infeng IR: graphs of transformer-shaped ops over typed SSA values."""
from .graph import Graph, Node, Value, Weight
from .parser import parse
from .printer import print_graph
from .types import SYMBOLS, TensorType, parse_type
from .verify import verify
from . import moe_ops as _moe_ops  # noqa: E402,F401  (registers router, experts, head_rms_norm, sigmoid_gate)

__all__ = ["Graph", "Node", "Value", "Weight", "parse", "print_graph", "SYMBOLS", "TensorType",
           "parse_type", "verify"]

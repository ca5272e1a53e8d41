"""Imports every pass module so that each registers itself with the pass manager."""
from . import cast_weights  # noqa: F401

__version__ = "0.1.0"

from . import quant as _quant  # noqa: E402,F401  (registers the storage formats and quantize_act with the IR)

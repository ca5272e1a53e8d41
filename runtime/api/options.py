"""``ServeOptions``: how ``infeng serve`` (and each Ray Serve replica) runs, checked before anything loads."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from infeng_common.errors import InfengError

from ..grammar_limits import GrammarLimits
from ..http_guard import AdapterRoots
from ..request_log import LOG_FORMATS, LOG_LEVELS
from ..spec import SpeculativeConfig

__all__ = ["ServeOptions"]


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 0
    max_seqs: int = 16
    max_context: int | None = None
    kv_memory: int | None = None
    max_waiting: int = 256
    max_batched_tokens: int | None = None
    prefix_cache: bool = True
    served_model_name: str | None = None
    adapters: dict[str, Path] = field(default_factory=dict)
    log_level: str = "info"
    log_format: str = "text"
    api_key: str | None = None
    adapter_roots: list[Path] = field(default_factory=list)
    trust_request_chat_template: bool = False
    max_request_bytes: int = 4 * 2 ** 20
    shutdown_timeout: float = 30.0
    speculative: SpeculativeConfig | None = None   # drafting for every request that does not say false
    always_include_usage: bool = False             # vLLM's --enable-force-include-usage
    grammar_timeout: float = GrammarLimits.compile_seconds
    grammar_mask_timeout: float = GrammarLimits.mask_seconds
    max_grammar_bytes: int = GrammarLimits.max_bytes

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_bytes=self.max_grammar_bytes, compile_seconds=self.grammar_timeout,
                             mask_seconds=self.grammar_mask_timeout)

    def check(self) -> None:
        """Raise InfengError (one line, naming the flag) for a value out of range."""
        ranges = [("--port", self.port, 1, 65535), ("--threads", self.threads, 0, None),
                  ("--max-seqs", self.max_seqs, 1, None), ("--max-context", self.max_context, 1, None),
                  ("--max-queue", self.max_waiting, 1, None),
                  ("--max-batched-tokens", self.max_batched_tokens, 1, None),
                  ("--max-request-bytes", self.max_request_bytes, 1024, None),
                  ("--shutdown-timeout", self.shutdown_timeout, 0, None),
                  ("--grammar-timeout", self.grammar_timeout, 0.1, 600),
                  ("--grammar-mask-timeout", self.grammar_mask_timeout, 0.1, 600),
                  ("--max-grammar-bytes", self.max_grammar_bytes, 16, 2 ** 26)]
        for flag, value, low, high in ranges:
            if value is None:
                continue
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                raise InfengError(f"{flag} {value}: must be {bound}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise InfengError(f"--log-level {self.log_level}: must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise InfengError(f"--log-format {self.log_format}: must be one of {', '.join(LOG_FORMATS)}")
        if self.api_key is not None and not self.api_key.strip():
            raise InfengError("--api-key (or INFENG_API_KEY) is empty")
        AdapterRoots(self.adapter_roots)

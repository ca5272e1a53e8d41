"""``ServeOptions``: how ``infeng serve`` (and each Ray Serve replica) runs, each option declared once
(flag, help, range, environment variable: ``infeng_common.options``), checked before anything loads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infeng_common.errors import InfengError
from infeng_common.options import SIZE, check_ranges, option

from ..grammar_limits import GrammarLimits
from ..spec.config import SpeculativeConfig, parse_speculative

__all__ = ["ServeOptions"]


def _speculative(text: str, flag: str) -> SpeculativeConfig | None:
    return parse_speculative(text)


@dataclass
class ServeOptions:
    """Each field is declared once, with its flag, help and range (``infeng_common.options``)."""

    host: str = option("127.0.0.1", flag="--host", help="bind address (loopback: this machine only)")
    port: int = option(8000, flag="--port", help="TCP port to listen on", low=1, high=65535)
    threads: int = option(0, flag="--threads", help="0 = one per physical core", low=0)
    max_seqs: int = option(16, flag="--max-seqs", help="sequences batched together (KV slots)", low=1)
    max_context: int | None = option(None, flag="--max-context", low=1,
                                     help="tokens per sequence; with --max-seqs it fixes the KV pool (default: the "
                                          "model's, cut to what the default pool holds)")
    kv_memory: int | None = option(None, flag="--kv-memory", **SIZE,
                                   help="KV pool size, e.g. 512MiB, committed as it is used (default: max-seqs x "
                                        "max-context, at most half the memory available)")
    max_queue: int = option(256, flag="--max-queue", help="waiting sequences before requests get 429", low=1)
    max_batched_tokens: int | None = option(None, flag="--max-batched-tokens", low=1,
                                            help="token budget per step (default: the library's max tokens per "
                                                 "call)")
    prefix_cache: bool = option(True, flag="--no-prefix-cache", help="never share KV blocks")
    served_model_name: str | None = option(None, flag="--served-model-name", help="the base model's id in the API")
    adapters: dict[str, Path] = option(flag="--adapter", help="serve a LoRA adapter as model NAME (repeatable)",
                                       metavar="NAME=DIR", default_factory=dict)
    log_level: str = option("info", flag="--log-level", help="trace, debug, info, warning, error or critical")
    log_format: str = option("text", flag="--log-format", help="text (key=value) or json")
    api_key: str | None = option(None, flag="--api-key", env="INFENG_API_KEY",
                                 help="require 'Authorization: Bearer KEY' on /v1 (prefer the INFENG_API_KEY "
                                      "environment variable)")
    adapter_roots: list[Path] = option(flag="--adapter-root", default_factory=list,
                                       help="allow POST /v1/adapters to load adapter directories under DIR "
                                            "(repeatable; off without it)")
    trust_request_chat_template: bool = option(False, flag="--trust-request-chat-template",
                                               help="run chat templates sent by clients")
    max_request_bytes: int = option(4 * 2 ** 20, flag="--max-request-bytes", low=1024, **SIZE,
                                    help="largest request body (413 beyond it)")
    shutdown_timeout: float = option(30.0, flag="--shutdown-timeout", low=0,
                                     help="seconds running requests get to finish on SIGTERM/SIGINT")
    speculative: SpeculativeConfig | None = option(None, flag="--speculative", parse=_speculative,
                                                   help="draft and verify several tokens per step: ngram (prompt "
                                                        "lookup), draft:ARTIFACT (a smaller model, same tokenizer); "
                                                        ":K caps the draft length")
    always_include_usage: bool = option(False, flag="--always-include-usage",
                                        help="end every stream with a usage chunk, whether or not the request asks "
                                             "(vLLM's --enable-force-include-usage)")
    grammar_timeout: float = option(GrammarLimits.compile_seconds, flag="--grammar-timeout", low=0.1, high=600,
                                    help="seconds one grammar may take to compile (its compiler process is killed "
                                         "past it; 400)")
    grammar_mask_timeout: float = option(GrammarLimits.mask_seconds, flag="--grammar-mask-timeout", low=0.1,
                                         high=600, help="seconds one next-token mask of a grammar may take (the "
                                                        "sequence ends with an error past it)")
    max_grammar_bytes: int = option(GrammarLimits.max_bytes, flag="--max-grammar-bytes", low=16, high=2 ** 26, **SIZE,
                                    help="largest grammar, regex, JSON schema or choice list (400 beyond it)")
    prefix_cache_dir: Path | None = option(None, flag="--prefix-cache-dir",
                                           help="save the prefix cache here at shutdown and load it at start "
                                                "(docs/serving.md)")
    warmup: bool = option(False, flag="--warmup", help="run a step of every shape before the port opens")
    ui: bool = option(True, flag="--no-ui", help="no chat page at / (the API alone)")

    def page_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_bytes=self.max_grammar_bytes, compile_seconds=self.grammar_timeout,
                             mask_seconds=self.grammar_mask_timeout)

    def check(self) -> None:
        """Raise InfengError (one line, naming the flag) for a value out of range."""
        from ..http_guard import AdapterRoots
        from ..request_log import LOG_FORMATS, LOG_LEVELS

        check_ranges(self)
        if self.log_level.lower() not in LOG_LEVELS:
            raise InfengError(f"--log-level {self.log_level}: must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise InfengError(f"--log-format {self.log_format}: must be one of {', '.join(LOG_FORMATS)}")
        if self.api_key is not None and not self.api_key.strip():
            raise InfengError("--api-key (or INFENG_API_KEY) is empty")
        AdapterRoots(self.adapter_roots)
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise InfengError("--prefix-cache-dir needs the prefix cache (drop --no-prefix-cache)")

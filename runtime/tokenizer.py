"""Tokenizer: Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, plus the bits of
``tokenizer_config.json`` a runtime needs (BOS/EOS, chat template), and incremental decoding."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from infeng_common.errors import ModelFormatError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class Tokenizer:
    def __init__(self, model_dir: str | Path, bos_token_id: int | None = None, eos_token_ids: list[int] | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(f"{path}: file not found (infeng needs a Hugging Face tokenizer.json)")
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise ModelFormatError(f"{path}: cannot load tokenizer: {e}") from None
        self.config: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                self.config = json.loads(cfg_path.read_text())
            except ValueError as e:
                raise ModelFormatError(f"{cfg_path}: malformed JSON: {e}") from None
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._token_id("bos_token")
        eos = eos_token_ids if eos_token_ids else [self._token_id("eos_token")]
        self.eos_token_ids = [e for e in eos if e is not None]
        self.add_bos = bool(self.config.get("add_bos_token", self.bos_token_id is not None))
        self.chat_template: str | None = self.config.get("chat_template")

    def _token_id(self, key: str) -> int | None:
        tok = self.config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self.hf.token_to_id(tok) if isinstance(tok, str) else None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; BOS prepended when ``add_bos`` (default: as tokenizer_config says)."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, context: list[int] = ()) -> "StreamDecoder":
        return StreamDecoder(self, context)


class StreamDecoder:
    """Turns token ids, one at a time, into text deltas (the prefix/read-offset scheme of TGI).

    ``context`` (the prompt's last few ids) is decoded with the new ids so that word-initial
    spaces come out right, then left out of the deltas; incomplete UTF-8 is held back.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, context: list[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context)[-self.CONTEXT_TOKENS:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

"""Tokenizer: Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, plus the bits of
``tokenizer_config.json`` a runtime needs (BOS/EOS, chat template), and incremental decoding.

``encode(text)`` gives the ids transformers' fast tokenizer gives for ``tokenizer(text)``: the
special tokens around the text are those of ``tokenizer.json``'s post-processor (transformers >= 5
ignores ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` when a ``tokenizer.json``
exists), the tokens that ``tokenizer_config.json`` declares special are matched whole, and the
truncation or padding a ``tokenizer.json`` may carry is not applied.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from infeng_common.errors import ModelFormatError
from infeng_common.jsonfile import read_json_object

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
#: transformers >= 4.43 saves the chat template here; it wins over ``chat_template`` in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
        self.hf.no_truncation()
        self.hf.no_padding()
        self.config: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            self.config = read_json_object(cfg_path)
        self._add_config_special_tokens()
        #: What the post-processor puts before and after a single text (``encode(text)``).
        self.prefix_ids, self.suffix_ids = self._special_affixes()
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._token_id("bos_token")
        if self.bos_token_id is None and len(self.prefix_ids) == 1:
            self.bos_token_id = self.prefix_ids[0]
        eos = eos_token_ids if eos_token_ids else [self._token_id("eos_token")]
        self.eos_token_ids = [e for e in eos if e is not None]
        #: Whether ``encode(text)`` starts with a special token (BOS), as the post-processor decides.
        self.add_bos = bool(self.prefix_ids)
        template_path = model_dir / CHAT_TEMPLATE_FILE
        try:
            jinja = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{template_path}: cannot read the chat template: {e}") from None
        self.chat_template: str | list | None = jinja if jinja is not None else self.config.get("chat_template")

    def _token_id(self, key: str) -> int | None:
        tok = self.config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self.hf.token_to_id(tok) if isinstance(tok, str) else None

    def _add_config_special_tokens(self) -> None:
        """Make the tokens tokenizer_config.json lists (``added_tokens_decoder``, the named special
        tokens, ``additional_special_tokens``) added tokens of the backend, matched whole as
        transformers does, where tokenizer.json has them only in its vocabulary. Tokens that are not in
        the vocabulary at all are left out: transformers would give them ids the model does not have."""
        have = {t.content for t in self.hf.get_added_tokens_decoder().values()}
        wanted: list[AddedToken] = []
        declared = self.config.get("added_tokens_decoder")
        for entry in (declared.values() if isinstance(declared, dict) else ()):
            if isinstance(entry, dict) and isinstance(entry.get("content"), str):
                wanted.append(AddedToken(entry["content"], single_word=bool(entry.get("single_word")),
                                         lstrip=bool(entry.get("lstrip")), rstrip=bool(entry.get("rstrip")),
                                         normalized=bool(entry.get("normalized", not entry.get("special"))),
                                         special=bool(entry.get("special"))))
        names = [self.config.get(key) for key in _NAMED_SPECIAL_TOKENS]
        for key in ("additional_special_tokens", "extra_special_tokens"):
            extra = self.config.get(key)
            names += list(extra.values()) if isinstance(extra, dict) else extra if isinstance(extra, list) else []
        for name in names:
            content = name.get("content") if isinstance(name, dict) else name
            if isinstance(content, str):
                wanted.append(AddedToken(content, special=True, normalized=False))
        new: dict[str, AddedToken] = {}
        for token in wanted:
            if token.content not in have and self.hf.token_to_id(token.content) is not None:
                new.setdefault(token.content, token)
        special = [t for t in new.values() if t.special]
        if special:
            self.hf.add_special_tokens(special)
        if len(special) < len(new):
            self.hf.add_tokens([t for t in new.values() if not t.special])

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        probe = "a"
        bare = self.hf.encode(probe, add_special_tokens=False).ids
        full = self.hf.encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                return full[:i], full[i + len(bare):]
        return [], []

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        ``add_bos=None``: with the special tokens transformers adds (``tokenizer(text)["input_ids"]``);
        ``True``: BOS prepended and nothing else (perplexity, calibration); ``False``: no special
        tokens added (a prompt rendered by a chat template, which writes its own).
        """
        if add_bos is None:
            return self.hf.encode(text, add_special_tokens=True).ids
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def encode_batch(self, texts: list[str], add_bos: bool | None = None) -> list[list[int]]:
        """``encode`` of each text; releases the GIL while the ``tokenizers`` library works."""
        if add_bos is None:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=True)]
        bos = [self.bos_token_id] if add_bos and self.bos_token_id is not None else []
        return [bos + e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

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

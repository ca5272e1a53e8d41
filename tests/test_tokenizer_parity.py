"""The runtime tokenizer against transformers: ``Tokenizer.encode(text)`` gives the ids of
``AutoTokenizer.from_pretrained(dir)(text)["input_ids"]``, special tokens included, for the
tokenizers of the shared assets (stories260K, SmolLM) and for small GPT-2, Qwen2 and Llama-3 style
tokenizers built here the way those families ship them (the same pre-tokenizers, post-processors and
tokenizer_config.json, a vocabulary trained on WikiText), over 1,000 WikiText lines and edge cases.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from infeng_runtime.chat import render_chat
from infeng_common.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = ("stories260K", "smollm", "gpt2", "qwen2", "llama3")
EDGE_CASES = [
    "", " ", "  two leading spaces", "\n", "\nnewline first", "\tTab", "trailing space ", "   multiple   spaces  ",
    "\r\nwindows\r\n", "héllo wörld — 日本語 🤗 Ελληνικά", "e\u0301 (decomposed) vs \u00e9", "\u00a0no-break",
    "1234567890 3.14159", "don't I'LL we've", "<s>", "a<s>b", " <s> hello </s>", "<unk>", "<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", " <|im_start|>", "x<|im_end|>y",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "x<tool_call>y",
    "<|im_start", "\x00control\x07", "\ufffd",
]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}"
               "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
               " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


@pytest.fixture(scope="module")
def wikitext(assets: Path) -> list[str]:
    return (assets / "text" / "wikitext-2-raw-v1-test.txt").read_text(encoding="utf-8").splitlines()


# ---------------------------------------------------------------------------------------------
# tokenizers built the way their families ship them
def _train(tokenizer, text: list[str], specials: list[str]):
    from tokenizers import AddedToken, pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tokenizer


def _save(tokenizer, out: Path, config: dict) -> Path:
    out.mkdir(parents=True)
    tokenizer.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in tokenizer.get_added_tokens_decoder().items()}
    (out / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added, **config}, indent=2))
    return out


def build_gpt2(out: Path, text: list[str]) -> Path:
    """GPT-2: byte-level BPE, a ByteLevel post-processor (adds nothing), <|endoftext|> last."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    tok = HFTokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False)
    _train(tok, text, ["<|endoftext|>"])
    return _save(tok, out, {"add_bos_token": False, "add_prefix_space": False, "bos_token": "<|endoftext|>",
                            "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
                            "model_max_length": 1024, "pad_token": None, "tokenizer_class": "GPT2Tokenizer",
                            "unk_token": "<|endoftext|>"})


def build_qwen2(out: Path, text: list[str]) -> Path:
    """Qwen2: NFC, a split regex then byte-level BPE, no BOS; ChatML tokens. tokenizer_config.json
    also declares ``<tool_call>`` special, which tokenizer.json has only in its vocabulary."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                 byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    _train(tok, text, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    out = _save(tok, out, {"add_prefix_space": False, "additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                                                     "<tool_call>"],
                           "bos_token": None, "chat_template": CHATML, "clean_up_tokenization_spaces": False,
                           "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 32768,
                           "pad_token": "<|endoftext|>", "split_special_tokens": False,
                           "tokenizer_class": "Qwen2Tokenizer", "unk_token": None})
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<tool_call>"] = 1 + max(tok.get_vocab(with_added_tokens=True).values())
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def build_llama3(out: Path, text: list[str]) -> Path:
    """Llama-3: a split regex then byte-level BPE (merges ignored for whole words), BOS from the
    post-processor's template; tokenizer_config.json says nothing about adding it."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _train(tok, text, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return _save(tok, out, {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_CHAT,
                            "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
                            "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
                            "tokenizer_class": "PreTrainedTokenizerFast"})


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory, assets: Path, wikitext: list[str]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    train = wikitext[1000:6000]          # the lines compared are wikitext[:1000]
    return {"stories260K": assets / "models" / "stories260K",
            "smollm": assets / "adapters" / "smollm-135m-instruct-medflashcards-5epochs",
            "gpt2": build_gpt2(root / "gpt2", train), "qwen2": build_qwen2(root / "qwen2", train),
            "llama3": build_llama3(root / "llama3", train)}


# ---------------------------------------------------------------------------------------------
# the reference
def _specials(d: Path) -> list[str]:
    return [t["content"] for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"]]


def _pre_tokenizer(tokenizer) -> str | None:
    return (json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}).get("type")


def reference(d: Path) -> Callable[[str, bool], list[int]]:
    """transformers' ids of a text (``add_special_tokens``), by the class AutoTokenizer picks.

    transformers >= 5 builds a SentencePiece-style llama tokenizer's pipeline in code
    (``LlamaTokenizer``: a Metaspace pre-tokenizer) rather than reading tokenizer.json's; the two
    differ where the text starts with a space or goes on after a special token (there " x" and "x"
    encode alike: the space is lost; huggingface/transformers#47700). infeng follows tokenizer.json,
    the file the checkpoint ships (what transformers 4.x gave, and SentencePiece: a leading space is
    its own piece); for those texts the reference is transformers' generic fast tokenizer over that
    file, ``PreTrainedTokenizerFast``.
    """
    auto = transformers.AutoTokenizer.from_pretrained(d)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    rebuilt = _pre_tokenizer(auto) == "Metaspace" != _pre_tokenizer(fast)
    specials = _specials(d)

    def ids(text: str, add_special_tokens: bool = True) -> list[int]:
        diverges = rebuilt and (text.startswith(" ") or any(s in text for s in specials))
        return (fast if diverges else auto)(text, add_special_tokens=add_special_tokens)["input_ids"]

    return ids


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_matches_transformers(tokenizer_dirs, wikitext, family: str) -> None:
    d = tokenizer_dirs[family]
    ours, ids = Tokenizer(d), reference(d)
    texts = wikitext[:1000] + EDGE_CASES
    for add_special_tokens, add_bos in ((True, None), (False, False)):
        wrong = [t for t in texts if ours.encode(t, add_bos=add_bos) != ids(t, add_special_tokens)]
        assert not wrong, (f"{len(wrong)} of {len(texts)} texts differ (add_special_tokens={add_special_tokens}), "
                           f"first {wrong[0]!r}: {ours.encode(wrong[0], add_bos=add_bos)} != "
                           f"{ids(wrong[0], add_special_tokens)}")
    assert ours.encode_batch(texts[:50]) == [ours.encode(t) for t in texts[:50]]
    assert ours.encode_batch(texts[:50], add_bos=False) == [ours.encode(t, add_bos=False) for t in texts[:50]]


@pytest.mark.parametrize("family, bos", [("stories260K", "<s>"), ("smollm", None), ("gpt2", None),
                                         ("qwen2", None), ("llama3", "<|begin_of_text|>")])
def test_bos_as_transformers_adds_it(tokenizer_dirs, family: str, bos: str | None) -> None:
    """``add_bos``/``bos_token_id`` say what ``encode`` prepends (the server prepends by them)."""
    d = tokenizer_dirs[family]
    tok, auto = Tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    assert auto("Hello")["input_ids"][:1] == ([auto.convert_tokens_to_ids(bos)] if bos else
                                              auto("Hello", add_special_tokens=False)["input_ids"][:1])
    assert tok.add_bos == (bos is not None) and tok.suffix_ids == []
    if bos:
        assert tok.bos_token_id == tok.hf.token_to_id(bos)
    for text in ("Hello world", "", " x"):
        assert tok.encode(text) == [tok.bos_token_id] * tok.add_bos + tok.encode(text, add_bos=False)


def test_smollm_prompt_gets_no_bos(tokenizer_dirs) -> None:
    """SmolLM's tokenizer_config.json names <|im_start|> its BOS token but nothing adds it: neither
    transformers nor infeng (even when config.json gives the model a bos_token_id)."""
    d = tokenizer_dirs["smollm"]
    tok = Tokenizer(d, bos_token_id=1, eos_token_ids=[2])
    assert tok.encode("Hello") == transformers.AutoTokenizer.from_pretrained(d)("Hello")["input_ids"] == [19556]
    assert tok.encode("Hello", add_bos=True) == [1, 19556]


def test_llama_leading_space_is_kept(tokenizer_dirs, wikitext) -> None:
    """Why infeng follows stories260K's tokenizer.json: a text's leading space survives the round trip."""
    tok = Tokenizer(tokenizer_dirs["stories260K"])
    spaced = [t for t in wikitext[:200] if t.startswith(" ") and t.strip()]
    assert spaced and all(tok.decode(tok.encode(t)) == t for t in spaced)
    assert tok.encode(" Hello") != tok.encode("Hello")


def test_config_special_tokens_are_matched_whole(tokenizer_dirs) -> None:
    tok = Tokenizer(tokenizer_dirs["qwen2"])
    tool = tok.hf.token_to_id("<tool_call>")
    assert tool in tok.encode("x<tool_call>y") and tok.decode(tok.encode("<tool_call>")) == ""


# ---------------------------------------------------------------------------------------------
# chat_template.jinja
@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_chat_template_jinja(tokenizer_dirs, tmp_path: Path, family: str) -> None:
    """A chat_template.jinja beside tokenizer_config.json wins over its chat_template, as in transformers."""
    d = tmp_path / family
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tokenizer_dirs[family] / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dirs[family] / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": " 4 "},
                {"role": "user", "content": "And <|im_start|> 3+3?"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text(template + "\n")
    for with_config_template in (False, True):
        if with_config_template:      # the file still wins
            (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'ignored' }}"}))
        tok, auto = Tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
        for generation_prompt in (True, False):
            want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            got = render_chat(tok, messages, add_generation_prompt=generation_prompt)
            assert got == want and "ignored" not in got
            assert tok.encode(got, add_bos=False) == auto(want, add_special_tokens=False)["input_ids"]

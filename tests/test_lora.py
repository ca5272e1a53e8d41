"""LoRA: PEFT import, merge-lora, dynamic slots, hot swap, errors — against PEFT itself.

Tolerance: max abs error <= 1e-4 * max|logit| against PEFT (f32 everywhere; the merge and the
slot kernels differ from PEFT only in summation order).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from infeng_common.errors import ModelFormatError
from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.frontends.peft import AdapterMismatchError, load_adapter
from infeng_runtime.adapters import AdapterError
from infeng_runtime.engine import Engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REL = 1e-4
IDS = [1, 504, 92, 3007, 18, 45000, 7, 311]


def close(got: np.ndarray, want: np.ndarray) -> None:
    err, bound = np.abs(got - want).max(), REL * np.abs(want).max()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def peft_logits(base_dir: Path, adapters: dict[str, Path], ids: list[list[int]], names: list[str | None]) -> np.ndarray:
    """Logits of PEFT with every adapter loaded, one row of ``ids`` per entry of ``names``
    (``adapter_names=`` mixes them in one batch; "__base__" is PEFT's name for no adapter)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    items = list(adapters.items())
    model = peft.PeftModel.from_pretrained(model, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    with torch.no_grad():
        if len(set(names)) == 1 and names[0] is not None:   # PEFT refuses adapter_names with DoRA
            model.set_adapter(names[0])
            out = model(torch.tensor(ids)).logits
        else:
            out = model(torch.tensor(ids), adapter_names=[n or "__base__" for n in names]).logits
    return out.numpy()


# -- the real adapters on a random SmolLM-135M-shaped base ------------------------------------
@pytest.fixture(scope="session")
def smollm_base(tmp_path_factory, assets) -> Path:
    """Random-init SmolLM-135M-shaped Llama (transformers, f32): the base the real adapters fit,
    with the real SmolLM tokenizer (shipped beside the adapters)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                      tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=2048)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("smollm") / "SmolLM-135M-Instruct"
    model.save_pretrained(out)
    tokenizer_dir = assets / "adapters" / "smollm-135m-instruct-medflashcards-5epochs"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def real_adapters(assets) -> dict[str, Path]:
    root = assets / "adapters"
    return {"med5": root / "smollm-135m-instruct-medflashcards-5epochs",
            "med100": root / "smollm-135m-instruct-medflashcards-100epochs"}


@pytest.fixture(scope="session")
def smollm_slots(tmp_path_factory, smollm_base, real_adapters) -> Path:
    out = tmp_path_factory.mktemp("art") / "slots.infeng"
    compile_model(smollm_base, out, CompileOptions(lora=real_adapters, lora_targets="q_proj+v_proj"))
    return out


def test_real_adapters_merged_match_peft(tmp_path, smollm_base, real_adapters):
    out = tmp_path / "merged.infeng"
    compile_model(smollm_base, out, CompileOptions(lora={"med5": real_adapters["med5"]}, merge=["med5"]))
    got = Engine(out).step(IDS, np.arange(len(IDS)), np.zeros(len(IDS)))
    close(got, peft_logits(smollm_base, {"med5": real_adapters["med5"]}, [IDS], ["med5"])[0])


def test_real_adapters_in_slots_match_peft_mixed_batch(smollm_slots, smollm_base, real_adapters):
    """One step holding the base, med5 and med100 sequences equals PEFT with adapter_names=."""
    engine = Engine(smollm_slots)
    assert set(engine.adapters.served) == {"med5", "med100"}
    names = [None, "med5", "med100"]
    n = len(IDS)
    got = engine.step(np.tile(IDS, 3), np.tile(np.arange(n), 3), np.repeat(np.arange(3), n),
                      adapter_slots=np.repeat([engine.adapter_slot(a) for a in names], n))
    want = peft_logits(smollm_base, real_adapters, [IDS] * 3, names)
    for i in range(3):
        close(got[i * n:(i + 1) * n], want[i])
    # each sequence alone gives what it gave in the mixed batch
    for i, name in enumerate(names):
        for s in range(3):
            engine.free(s)
        alone = engine.step(IDS, np.arange(n), np.zeros(n), adapter_slots=np.full(n, engine.adapter_slot(name)))
        np.testing.assert_allclose(alone, got[i * n:(i + 1) * n], rtol=0, atol=1e-5 * np.abs(alone).max())


def test_run_cli_with_adapter_equals_merged(tmp_path, smollm_slots, smollm_base, real_adapters):
    merged = tmp_path / "merged100.infeng"
    compile_model(smollm_base, merged, CompileOptions(lora={"med100": real_adapters["med100"]}, merge=["med100"]))
    args = ["Question: what is the", "-n", "12", "--json"]
    a = CliRunner().invoke(app, ["run", str(merged), *args])
    b = CliRunner().invoke(app, ["run", str(smollm_slots), "--use", "med100", *args])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    ids = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (a, b)]
    assert ids[0] == ids[1] and len(ids[0]) > 0


# -- PEFT features on a tiny base -------------------------------------------------------------
def make_adapter(base_dir: Path, out: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out)
    return out


VARIANTS = {
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj"]),
    "all-linear": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "rank-pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                         rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 3}),
    "regex": dict(r=4, lora_alpha=4, target_modules=r".*\.(k_proj|down_proj)"),
    "layers": dict(r=4, lora_alpha=4, target_modules=["k_proj", "down_proj"], layers_to_transform=[1]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "gate_proj"]),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peft_variants_match(tmp_path, hf_checkpoint, variant):
    base = hf_checkpoint("llama")
    adapter = make_adapter(base, tmp_path / variant, 1, **VARIANTS[variant])
    ids = np.array([i % 256 for i in IDS[:5]])
    want = peft_logits(base, {"a": adapter}, [list(ids)], ["a"])[0]
    merged = tmp_path / "merged.infeng"
    compile_model(base, merged, CompileOptions(lora={"a": adapter}, merge=["a"]))
    close(Engine(merged).step(ids, np.arange(5), np.zeros(5)), want)
    if variant == "dora":
        return  # DoRA is merge-only (see test_dora_is_refused_in_slots)
    slots = tmp_path / "slots.infeng"
    compile_model(base, slots, CompileOptions(lora={"a": adapter}))
    engine = Engine(slots)
    close(engine.step(ids, np.arange(5), np.zeros(5), adapter_slots=np.full(5, engine.adapter_slot("a"))), want)


def test_gpt2_conv1d_adapter_matches(tmp_path, hf_checkpoint):
    base = hf_checkpoint("gpt2")
    adapter = make_adapter(base, tmp_path / "g", 2, r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                           fan_in_fan_out=True)
    ids = [1, 50, 7, 99]
    want = peft_logits(base, {"a": adapter}, [ids], ["a"])[0]
    out = tmp_path / "slots.infeng"
    compile_model(base, out, CompileOptions(lora={"a": adapter}))
    engine = Engine(out)
    close(engine.step(ids, np.arange(4), np.zeros(4), adapter_slots=np.full(4, engine.adapter_slot("a"))), want)


def test_dora_is_refused_in_slots(tmp_path, hf_checkpoint):
    base = hf_checkpoint("llama")
    adapter = make_adapter(base, tmp_path / "d", 3, **VARIANTS["dora"])
    out = tmp_path / "slots.infeng"
    compile_model(base, out, CompileOptions(max_adapters=2))
    with pytest.raises(AdapterError, match="DoRA"):
        Engine(out).load_adapter("d", adapter)


# -- hot swap and errors ------------------------------------------------------------------------
@pytest.fixture()
def one_slot(tmp_path, hf_checkpoint) -> tuple[Engine, Path, Path]:
    base = hf_checkpoint("llama")
    a = make_adapter(base, tmp_path / "a", 4, r=4, lora_alpha=8, target_modules=["q_proj"])
    b = make_adapter(base, tmp_path / "b", 5, r=4, lora_alpha=8, target_modules=["q_proj"])
    out = tmp_path / "one.infeng"
    compile_model(base, out, CompileOptions(max_adapters=1, max_rank=4))
    return Engine(out), a, b


def test_hot_swap_evicts_the_idle_adapter(one_slot):
    engine, a, b = one_slot
    ids = np.array([1, 2, 3])
    engine.load_adapter("a", a)
    with_a = engine.step(ids, np.arange(3), np.zeros(3), adapter_slots=np.full(3, engine.adapter_slot("a")))
    engine.free(0)
    engine.load_adapter("b", b)                      # a is idle: evicted from the slot, still served
    assert engine.adapters.resident == {"b": 0} and set(engine.adapters.served) == {"a", "b"}
    again = engine.step(ids, np.arange(3), np.zeros(3), adapter_slots=np.full(3, engine.adapter_slot("a", seq=0)))
    np.testing.assert_array_equal(again, with_a)     # a came back (from memory) into b's slot
    assert engine.adapters.resident == {"a": 0}
    with pytest.raises(AdapterError, match="in use"):   # a sequence still runs with a
        engine.adapter_slot("b", seq=1)
    engine.free(0)
    assert engine.adapter_slot("b", seq=1) == 0
    engine.free(1)
    engine.unload_adapter("a")
    engine.unload_adapter("b")
    assert engine.adapters.resident == {} and engine.adapters.served == {}


def test_adapter_errors_name_the_problem(one_slot, tmp_path, hf_checkpoint, real_adapters):
    engine, a, _ = one_slot
    with pytest.raises(AdapterMismatchError, match=r"q_proj\.lora_A/B has shapes \[16, 576\]"):
        engine.load_adapter("other-base", real_adapters["med5"])
    big = make_adapter(hf_checkpoint("llama"), tmp_path / "big", 6, r=8, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="rank 8 exceeds the artifact's max rank 4"):
        engine.load_adapter("big", big)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(a, corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match="adapter_model.safetensors: truncated"):
        engine.load_adapter("corrupt", corrupt)
    missing = tmp_path / "missing"
    shutil.copytree(a, missing)
    cfg = json.loads((missing / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj"]          # k_proj targeted, but no tensors for it
    (missing / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterMismatchError, match="target module model.layers.0.self_attn.k_proj"):
        engine.load_adapter("missing", missing)
    (tmp_path / "pickle").mkdir()
    shutil.copy(a / "adapter_config.json", tmp_path / "pickle")
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(ModelFormatError, match="pickled adapters are not loaded"):
        engine.load_adapter("pickle", tmp_path / "pickle")
    # the engine keeps serving: a good adapter still loads and runs
    engine.load_adapter("a", a)
    assert engine.step([1, 2], [0, 1], [0, 0], adapter_slots=[0, 0]).shape == (2, 256)


def test_other_base_is_a_warning_not_an_error(hf_checkpoint, tmp_path):
    base = hf_checkpoint("llama")
    adapter = make_adapter(base, tmp_path / "w", 7, r=2, lora_alpha=2, target_modules=["q_proj"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "someone/another-model"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_adapter(adapter, import_hf(base))
    assert any("another-model" in str(w.message) for w in caught)


def test_cli_refuses_unknown_merge(hf_checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["compile", str(hf_checkpoint("llama")), "-o", str(tmp_path / "x"),
                                      "--merge", "nope"])
    assert result.exit_code == 2 and "--lora nope=DIR" in result.output

"""Compiled artifacts against the numpy interpreter, for every ISA this host runs and each family.

Tolerances: f32 weights, max abs error <= 1e-4 * max|logit| (accumulation order is the only
difference); f16/bf16 weights, <= 2e-2 * max|logit| against the interpreter of the same graph
(which rounds weights through the format, so what remains is the kernels' arithmetic, e.g.
vdpbf16ps rounding activations to bf16), plus the cast pass's own tolerance against f32.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.codegen.target import TARGETS, host_features, runnable_targets
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.passes.cast_weights import CastWeights
from infeng_compiler.passes.manager import PassManager, parse_pipeline
from infeng_runtime.engine import CPUFeatureError, Engine
from _isa import isa_params

RUNNABLE_ISAS = runnable_targets()
FAMILIES = ("llama", "llama3-rope", "mistral", "qwen2", "gpt2")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, hf_checkpoint):
    """``compiled(variant, target, dtype)``: an artifact directory, compiled once per session."""
    root = tmp_path_factory.mktemp("artifacts")
    done: dict[tuple, Path] = {}

    def get(variant: str, target: str = "native", dtype: str = "f32", model: Path | None = None) -> Path:
        key = (variant, target, dtype)
        if key not in done:
            out = root / f"{variant}-{target}-{dtype}.infeng"
            compile_model(model or hf_checkpoint(variant), out, CompileOptions(target=target, dtype=dtype))
            done[key] = out
        return done[key]

    return get


def run_batch(backend, prompts: list[list[int]], decode_steps: int) -> list[np.ndarray]:
    """Prefill two sequences of different lengths in one step, then decode both together.

    Returns the logits of every step (last row of each sequence) and feeds back greedy tokens.
    """
    lens = [len(p) for p in prompts]
    out = [backend.step(np.concatenate(prompts), np.concatenate([np.arange(n) for n in lens]),
                        np.repeat(np.arange(len(prompts)), lens), np.cumsum(lens) - 1)]
    pos = np.array(lens)
    for _ in range(decode_steps):
        tokens = out[-1].argmax(axis=1)
        out.append(backend.step(tokens, pos, np.arange(len(prompts))))
        pos = pos + 1
    for s in range(len(prompts)):
        backend.free(s)
    return out


PROMPTS = [[1, 17, 33, 5, 90, 11, 7, 64, 3, 2, 100], [1, 42, 8, 19, 77]]


def assert_close(got: list[np.ndarray], want: list[np.ndarray], rel: float) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        err = np.abs(g - w).max()
        bound = rel * np.abs(w).max()
        assert err <= bound, f"step {step}: max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("isa", isa_params(RUNNABLE_ISAS))
@pytest.mark.parametrize("family", FAMILIES)
def test_f32_matches_interpreter(compiled, hf_checkpoint, family, isa):
    engine = Engine(compiled(family, isa))
    want = run_batch(Interpreter(import_hf(hf_checkpoint(family))), PROMPTS, 6)
    assert_close(run_batch(engine, PROMPTS, 6), want, 1e-4)


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512", "avx512-bf16") if i in RUNNABLE_ISAS] + ["scalar"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_weights_match_interpreter(compiled, hf_checkpoint, dtype, isa):
    engine = Engine(compiled("llama", isa, dtype))
    graph = import_hf(hf_checkpoint("llama"))
    f32 = run_batch(Interpreter(graph), PROMPTS, 4)
    PassManager(parse_pipeline(f"cast-weights({dtype})")).run(graph)
    got = run_batch(engine, PROMPTS, 4)
    kernel_tolerance = 2e-2
    assert_close(got, run_batch(Interpreter(graph), PROMPTS, 4), kernel_tolerance)
    assert_close(got, f32, CastWeights(dtype).tolerance + kernel_tolerance)   # the pass's, then the kernels'



def test_half_precision_checkpoint_compiles(compiled, hf_checkpoint):
    """A bf16 checkpoint compiled at f32 equals the interpreter of that checkpoint."""
    engine = Engine(compiled("qwen2-bf16"))
    want = run_batch(Interpreter(import_hf(hf_checkpoint("qwen2-bf16"))), PROMPTS, 3)
    assert_close(run_batch(engine, PROMPTS, 3), want, 1e-4)


def test_mixed_batch_equals_one_at_a_time(compiled):
    """Sequences at different positions in one step give what each gives alone."""
    engine = Engine(compiled("llama"))
    a, b = PROMPTS
    alone_a = run_batch(engine, [a], 3)
    alone_b = run_batch(engine, [b], 3)
    # a prefill chunk of b together with decode tokens of a, in one step
    engine.step(np.array(a), np.arange(len(a)), np.zeros(len(a)), np.array([len(a) - 1]))
    mixed = engine.step(np.concatenate([[alone_a[0].argmax()], b]),
                        np.concatenate([[len(a)], np.arange(len(b))]),
                        np.concatenate([[0], np.ones(len(b))]), np.array([0, len(b)]))
    np.testing.assert_allclose(mixed[0], alone_a[1][0], rtol=0, atol=1e-5 * np.abs(alone_a[1]).max())
    np.testing.assert_allclose(mixed[1], alone_b[0][0], rtol=0, atol=1e-5 * np.abs(alone_b[0]).max())


def test_prefill_longer_than_one_call(tmp_path, synthetic_checkpoint):
    """A prompt longer than max_tokens is split into calls; the KV cache carries across them."""
    artifact = tmp_path / "small-calls.infeng"
    compile_model(synthetic_checkpoint("tiny-llama"), artifact, CompileOptions(max_tokens=64))
    engine = Engine(artifact)
    ids = list(np.random.default_rng(0).integers(0, 500, size=engine.max_tokens + 37))
    interp = Interpreter(import_hf(synthetic_checkpoint("tiny-llama")))
    want = interp.step(ids, np.arange(len(ids)), np.zeros(len(ids)), np.array([0, len(ids) - 1]))
    got = engine.step(ids, np.arange(len(ids)), np.zeros(len(ids)), np.array([0, len(ids) - 1]))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_stories260k_perplexity(compiled, stories_dir, assets):
    artifact = compiled("stories260K", model=stories_dir)
    result = CliRunner().invoke(app, ["eval", str(artifact), "--ppl", str(assets / "text/wikitext-2-raw-v1-test.txt"),
                                      "--max-bytes", "100000", "--ctx", "256", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["chunks"] == 247 and report["backend"] == "compiled"
    assert abs(report["ppl"] - 143.13) / 143.13 <= 5e-4


def test_second_compile_hits_the_cache(tmp_path, stories_dir):
    options = CompileOptions(target="native")
    compile_model(stories_dir, tmp_path / "a.infeng", options)
    again = compile_model(stories_dir, tmp_path / "b.infeng", options, reuse=False)
    assert again.cache_hit and "build" in again.stages


def test_recompile_copies_the_unchanged_artifact(tmp_path, stories_dir):
    """A recompile from the same inputs copies the artifact built before (same bytes, no passes), but
    not once that artifact or an input changed since (size, modification time: infeng_compiler/reuse.py)."""
    model = tmp_path / "model"
    shutil.copytree(stories_dir, model)
    options = CompileOptions(target="native")
    first = compile_model(model, tmp_path / "a.infeng", options)
    assert "passes" in first.stages
    again = compile_model(model, tmp_path / "b.infeng", options)
    assert list(again.stages) == ["reuse"] and again.pipeline == first.pipeline
    for name in ("weights.bin", "libmodel.so", "manifest.json", "ir.txt"):
        assert (tmp_path / "a.infeng" / name).read_bytes() == (tmp_path / "b.infeng" / name).read_bytes()
    in_place = compile_model(model, tmp_path / "b.infeng", options)       # nothing to write
    assert list(in_place.stages) == ["reuse"]
    with open(tmp_path / "b.infeng" / "weights.bin", "ab") as f:          # the recorded artifact edited
        f.write(b"\0")
    assert "passes" in compile_model(model, tmp_path / "c.infeng", options).stages
    weights = model / "model.safetensors"
    stamp = weights.stat()
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))    # an input touched
    assert "passes" in compile_model(model, tmp_path / "d.infeng", options).stages


def test_missing_isa_is_a_clear_error(compiled, monkeypatch):
    artifact = compiled("llama", "avx2")
    monkeypatch.setenv("INFENG_CPU_FEATURES", "sse2,fma")
    with pytest.raises(CPUFeatureError, match="avx2"):
        Engine(artifact)
    result = CliRunner().invoke(app, ["run", str(artifact), "hello"])
    assert result.exit_code == 2
    assert "lacks avx2" in result.output and "Traceback" not in result.output


def test_amx_artifact_loads_only_where_the_cpu_has_amx(tmp_path, stories_dir, monkeypatch):
    """AMX is built on every host. Where AMX is not usable (CPUID, XCR0 or the kernel's permission:
    the library's check asks all three when it loads), loading names what is missing; where it is
    (some of this project's machines are Xeons with AMX), the artifact runs its tile kernels and
    gives the avx512-bf16 build's tokens. Taking amx_bf16 away with INFENG_CPU_FEATURES refuses the
    load on either kind of host."""
    artifact = tmp_path / "amx.infeng"
    compile_model(stories_dir, artifact, CompileOptions(target="amx"))
    assert (artifact / "libmodel.so").is_file()
    if TARGETS["amx"].missing_features():
        with pytest.raises(CPUFeatureError, match="amx_tile"):
            Engine(artifact)
    else:
        bf16 = tmp_path / "bf16.infeng"
        compile_model(stories_dir, bf16, CompileOptions(target="avx512-bf16"))
        ids = Engine(bf16).tokenizer.encode("Once upon a time")
        want = Engine(bf16, threads=1).step(ids, np.arange(len(ids)), np.zeros(len(ids))).argmax(axis=1)
        got = Engine(artifact, threads=1).step(ids, np.arange(len(ids)), np.zeros(len(ids))).argmax(axis=1)
        np.testing.assert_array_equal(got, want)
    monkeypatch.setenv("INFENG_CPU_FEATURES", ",".join(sorted(host_features() - {"amx_bf16"})))
    with pytest.raises(CPUFeatureError, match="amx_bf16"):
        Engine(artifact)


def test_artifact_layout(compiled):
    artifact = compiled("llama")
    manifest = json.loads((artifact / "manifest.json").read_text())
    for name in ("libmodel.so", "weights.bin", "ir.txt", "manifest.json"):
        assert (artifact / name).is_file()
    assert (artifact / "src" / "model.c").is_file()
    assert manifest["format_version"] == 1 and manifest["pipeline"] == "cast-weights(f32),fuse-linears,plan-memory"
    assert all(t["offset"] % 64 == 0 for t in manifest["tensors"])
    assert (artifact / "weights.bin").stat().st_size == manifest["weights_bytes"]


def test_run_and_generate_cli(compiled, stories_dir):
    artifact = compiled("stories260K", model=stories_dir)
    result = CliRunner().invoke(app, ["run", str(artifact), "Once upon a time", "-n", "16", "--json"])
    assert result.exit_code == 0, result.output
    compiled_out = json.loads(result.stdout.strip().splitlines()[-1])
    result = CliRunner().invoke(app, ["generate", str(stories_dir), "Once upon a time", "-n", "16", "--json"])
    interp_out = json.loads(result.stdout.strip().splitlines()[-1])
    assert compiled_out["token_ids"] == interp_out["token_ids"]
    assert compiled_out["tok_s"] > 0


def test_demo_offline(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--offline", "--dir", str(tmp_path), "-n", "8"])
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output

"""MXFP4 (GPT-OSS's expert weights): the format against transformers' and gguf-py's dequantization;
the linear kernels of every ISA this host runs (the scalar reference included) against the
dequantized product in float64, within F32_TOL; MXFP4 linears and GPT-OSS's MXFP4 experts compiled
against the interpreter and transformers; the GPT-OSS-shape checkpoint builder and its GGUF at a
tiny scale. One kernel library per ISA, built once per session (cached on disk by build.py)."""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _isa import isa_params
from _kernel_lib import KernelLib, rel_err

import infeng_compiler.codegen.quant_kernels  # noqa: F401  (registers the kernels)
from infeng_common.errors import InfengError
from infeng_compiler.codegen.kernels import KernelSpec, template_isa
from infeng_compiler.codegen.quant_kernels import mxfp4_rows_prototype
from infeng_compiler.codegen.target import TARGETS, host_features, runnable_targets
from infeng_compiler.quant.act import fake_quant, pack_act_rows
from infeng_compiler.quant.formats import MXFP4, get_format, is_quantized, mxfp4_quantize, mxfp4_tensor, mxfp4_to_ggml

HOST = host_features()
RUNNABLE = runnable_targets(HOST)
F32_TOL = 1e-5                 # max abs error / max |reference|: only the float summation order differs

# (K, N): one block, a partial group of 4 blocks (K = 96, 2880: GPT-OSS's hidden size), whole
# groups; N odd and not a multiple of any row tile
LINEAR_SHAPES = [(32, 7), (96, 33), (128, 16), (2880, 13), (320, 70)]
TOKENS = [1, 2, 3, 5, 9]


def random_mxfp4(shape: tuple[int, ...], seed: int):
    """Random blocks and scales, every code and a spread of exponents (no e8m0 0 or 255)."""
    rng = np.random.default_rng(seed)
    *outer, K = shape
    blocks = rng.integers(0, 256, size=(*outer, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 130, size=(*outer, K // 32), dtype=np.uint8)
    return mxfp4_tensor(blocks, scales)


# -- the format --------------------------------------------------------------------------------
def test_dequantize_matches_transformers_and_gguf() -> None:
    torch = pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    qt = random_mxfp4((3, 40, 96), 0)
    qt.scales[0, 0, 0], qt.scales[1, 2, 1], qt.scales[2, 3, 2] = 1, 200, 0     # tiny and huge powers of two too
    ours = qt.dequantize()
    assert ours.shape == (3, 40, 96) and ours.dtype == np.float32
    for dtype in (torch.float32, torch.bfloat16):                  # transformers returns [E, K, N]
        theirs = convert_moe_packed_tensors(torch.from_numpy(qt.codes), torch.from_numpy(qt.scales), dtype=dtype)
        assert np.array_equal(theirs.float().transpose(1, 2).numpy(), ours)
    ggml = mxfp4_to_ggml(qt.codes, qt.scales)
    assert ggml.shape == (3, 40, 96 // 32 * 17)
    back = gguf.quants.dequantize(ggml, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(np.asarray(back).reshape(ours.shape), ours)
    qt.scales[0, 1, 1] = 0xFF                                      # 2^128: inf, or 0 for the code 0
    theirs = convert_moe_packed_tensors(torch.from_numpy(qt.codes), torch.from_numpy(qt.scales), dtype=torch.float32)
    assert np.array_equal(theirs.transpose(1, 2).numpy(), qt.dequantize())


def test_pack_is_the_checkpoint_bytes() -> None:
    """Matrix by matrix (expert by expert): the blocks, then the scales, as the checkpoint has them."""
    qt = random_mxfp4((2, 24, 64), 1)
    data = qt.pack()
    assert data.size == MXFP4.nbytes((2, 24, 64)) == 2 * 24 * 2 * 17
    per_expert = 24 * 2 * 17
    for e in range(2):
        matrix = data[e * per_expert:(e + 1) * per_expert]
        assert np.array_equal(matrix[:24 * 2 * 16], qt.codes[e].reshape(-1))
        assert np.array_equal(matrix[24 * 2 * 16:], qt.scales[e].reshape(-1))
    back = MXFP4.unpack(data, (2, 24, 64))
    assert np.array_equal(back.codes, qt.codes) and np.array_equal(back.scales, qt.scales)
    assert is_quantized("mxfp4") and get_format("mxfp4") is MXFP4


def test_quantize_rounds_like_gguf() -> None:
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    qt = mxfp4_quantize(w)
    theirs = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(mxfp4_to_ggml(qt.codes, qt.scales), theirs)


def test_bad_shapes_are_one_line_errors() -> None:
    with pytest.raises(InfengError, match="K = 40 is not a multiple of 32"):
        mxfp4_quantize(np.zeros((4, 40), np.float32))
    with pytest.raises(InfengError, match="blocks must be"):
        mxfp4_tensor(np.zeros((4, 2, 8), np.uint8), np.zeros((4, 2), np.uint8))
    with pytest.raises(InfengError, match="do not fit"):
        mxfp4_tensor(np.zeros((4, 2, 16), np.uint8), np.zeros((4, 3), np.uint8))


# -- kernels -----------------------------------------------------------------------------------
def grid_specs(isa: str) -> list[KernelSpec]:
    return [KernelSpec.make("linear_mxfp4", isa, K=K, N=N, act=act) for K, N in LINEAR_SHAPES for act in ("f32", "q8")]


@functools.cache
def mxfp4_lib(isa: str) -> KernelLib:
    specs = grid_specs(isa)
    return KernelLib(isa, specs, "".join(mxfp4_rows_prototype(s) + ";\n" for s in specs))


@pytest.fixture(scope="session", params=isa_params(RUNNABLE))
def mlib(request) -> KernelLib:
    return mxfp4_lib(request.param)


def test_every_isa_has_a_template_path() -> None:
    for isa in TARGETS:
        spec = KernelSpec.make("linear_mxfp4", isa, K=64, N=16, act="q8")
        assert template_isa(spec) == ("scalar" if isa == "scalar" else "avx2" if isa.startswith("avx2") else "avx512"), isa


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("K,N", LINEAR_SHAPES)
def test_linear_mxfp4(mlib: KernelLib, K: int, N: int, act: str) -> None:
    """y = x @ dequantize(W)^T (+ bias): f32 activations as they are, q8 ones as the int8 rows stand
    for them (fake_quant); on every ISA and through the per-expert ``_rows`` entry too."""
    spec = KernelSpec.make("linear_mxfp4", mlib.isa, K=K, N=N, act=act)
    qt = random_mxfp4((N, K), K + N)
    w = np.ascontiguousarray(qt.pack())
    deq = qt.dequantize().astype(np.float64)
    rng = np.random.default_rng(N)
    bias = rng.standard_normal(N).astype(np.float32)
    for T in TOKENS:
        x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10, size=(T, 1))).astype(np.float32)
        x_in = x if act == "f32" else pack_act_rows(x, 8)
        x_ref = x if act == "f32" else fake_quant(x, 32, 8)
        ref = x_ref.astype(np.float64) @ deq.T + bias
        y = np.full((T, N), np.nan, np.float32)
        getattr(mlib.lib, spec.symbol)(mlib.pool, mlib.ptr(x_in, "void *"), T, mlib.ptr(w, "uint8_t *"),
                                       mlib.ptr(bias, "float *"), mlib.ptr(y, "float *"))
        assert rel_err(y, ref) < F32_TOL, (mlib.isa, K, N, act, T, rel_err(y, ref))
        # a token row's outputs are the same bits whatever the number of rows (speculative decoding)
        last = np.full((1, N), np.nan, np.float32)
        getattr(mlib.lib, spec.symbol)(mlib.pool, mlib.ptr(np.ascontiguousarray(x_in[-1:]), "void *"), 1,
                                       mlib.ptr(w, "uint8_t *"), mlib.ptr(bias, "float *"), mlib.ptr(last, "float *"))
        assert np.array_equal(last[0], y[-1]), (mlib.isa, K, N, act, T)
        # rows 1 .. N-1 of the matrix through the per-expert entry, into a wider output
        ldy = N + 5
        y_rows = np.full((T, ldy), np.nan, np.float32)
        blocks, scales = np.ascontiguousarray(qt.codes), np.ascontiguousarray(qt.scales)
        getattr(mlib.lib, spec.symbol + "_rows")(mlib.ptr(x_in, "void *"), T, mlib.ptr(blocks, "uint8_t *"),
                                                 mlib.ptr(scales, "uint8_t *"), mlib.ffi.NULL, 1, N,
                                                 mlib.ptr(y_rows, "float *"), ldy)
        assert np.all(np.isnan(y_rows[:, 0])) and np.all(np.isnan(y_rows[:, N:]))
        assert rel_err(y_rows[:, 1:N], ref[:, 1:] - bias[1:]) < F32_TOL, (mlib.isa, K, N, act, T)


def test_stacked_experts_are_consecutive_matrices(mlib: KernelLib) -> None:
    """Expert e of a packed [E, N, K] stack is the [N, K] layout at e * nbytes / E (the experts driver's offset)."""
    E, N, K = 3, 33, 96
    spec = KernelSpec.make("linear_mxfp4", mlib.isa, K=K, N=N, act="f32")
    qt = random_mxfp4((E, N, K), 7)
    w = np.ascontiguousarray(qt.pack())
    deq = qt.dequantize().astype(np.float64)
    x = np.random.default_rng(7).standard_normal((2, K)).astype(np.float32)
    for e in range(E):
        y = np.full((2, N), np.nan, np.float32)
        getattr(mlib.lib, spec.symbol)(mlib.pool, mlib.ptr(x, "void *"), 2, mlib.ptr(w, "uint8_t *") + e * w.size // E,
                                       mlib.ffi.NULL, mlib.ptr(y, "float *"))
        assert rel_err(y, x.astype(np.float64) @ deq[e].T) < F32_TOL, (mlib.isa, e)


# -- compiled: linear nodes with MXFP4 weights lower to linear_mxfp4 ---------------------------
def _mxfp4_linears(graph, int8_rows: bool) -> int:
    """Every linear whose K is whole blocks gets MXFP4 weights (rounded from its f32 values); with
    ``int8_rows`` each reads int8 activation rows from a quantize_act (8 bits, blocks of 32)."""
    changed = 0
    producers = {name: p for name, p in graph.producers().items()}
    for n in list(graph.nodes):
        w = n.weights[0] if n.op == "linear" and n.weights else None
        if w is None or w.type.shape[1] % 32:
            continue
        w.quant = mxfp4_quantize(w.numpy_f32())
        w.attrs["format"] = "mxfp4"
        changed += 1
        if int8_rows and getattr(producers.get(n.inputs[0].name), "op", None) != "quantize_act":
            q = graph.add_node("quantize_act", [n.inputs[0]], attrs={"bits": 8, "block": 32},
                               out_names=[graph.fresh(f"{n.inputs[0].name}.q8")])
            graph.nodes.pop()
            graph.nodes.insert(graph.nodes.index(n), q)
            n.inputs[0] = q.output
            producers[q.output.name] = q
    return changed


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_compiled_mxfp4_linears_match_interpreter(stories_dir, tmp_path, monkeypatch, act: str) -> None:
    import infeng_compiler.compile as compile_module
    from infeng_compiler.interp import Interpreter
    from infeng_compiler.passes.plan_memory import plan_memory
    from infeng_runtime.engine import Engine

    graphs = []
    run_pipeline = compile_module.run_pipeline

    def with_mxfp4(*args, **kwargs):
        passed = run_pipeline(*args, **kwargs)
        assert _mxfp4_linears(passed.graph, act == "q8") > 0
        passed.graph.memory = plan_memory(passed.graph)   # the graph changed after the pipeline's plan
        graphs.append(passed.graph)
        return passed

    monkeypatch.setattr(compile_module, "run_pipeline", with_mxfp4)
    out = tmp_path / "m.infeng"
    compile_module.compile_model(stories_dir, out, compile_module.CompileOptions(), reuse=False)   # runs the pipeline
    manifest = (out / "manifest.json").read_text()
    assert f"linear_mxfp4_k64_n64_{act}" in manifest and '"format": "mxfp4"' in manifest
    ids = np.array([1, 45, 300, 12, 7, 99, 250, 3, 60, 411, 5], np.int32)
    n = len(ids)
    ref = Interpreter(graphs[0]).step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    engine = Engine(out, max_seqs=2)
    got = engine.step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    # f32: only the order of float sums differs; q8: an int8 code may round the other way when the
    # C norms' f32 inputs differ from the interpreter's float64 ones (tests/test_quant_compiled.py)
    assert rel_err(got, ref) <= (1e-4 if act == "f32" else 1e-2), rel_err(got, ref)
    steps = [engine.step(ids[i:i + 1], np.array([i], np.int32), np.array([1], np.int32)) for i in range(n)]
    assert rel_err(np.concatenate(steps), got) <= (1e-4 if act == "f32" else 1e-2)


# -- the GPT-OSS-shape checkpoint builder --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> tuple:
    from infeng_models.gpt_oss_shape import TINY, write_checkpoint, write_gguf

    root = tmp_path_factory.mktemp("gpt_oss")
    model = write_checkpoint(root / "model", TINY, seed=3)
    return model, write_gguf(model, root / "model.gguf")


def test_full_shape_is_gpt_oss_20b() -> None:
    from infeng_models.gpt_oss_shape import GPT_OSS_20B, config_json, shard_specs

    config = config_json(GPT_OSS_20B)
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["num_local_experts"],
            config["num_experts_per_tok"], config["vocab_size"], config["intermediate_size"],
            config["sliding_window"]) == (24, 2880, 64, 8, 64, 32, 4, 201088, 2880, 128)
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(config["layer_types"]) == 24
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 32.0
    specs = [s for shard in shard_specs(GPT_OSS_20B) for s in shard]
    params = sum(s.numel * (2 if s.init == "blocks" else 1) for s in specs if s.init != "scales")
    assert params == 20_914_757_184                       # gpt-oss-20b's parameter count
    assert len(shard_specs(GPT_OSS_20B)) == 6


def test_tiny_checkpoint_loads_in_transformers(tiny_gpt_oss) -> None:
    """transformers reads the builder's MXFP4 experts as frontends/mxfp4.py does (bit for bit)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from infeng_common.safetensors import read_safetensors_header
    from infeng_compiler.frontends.mxfp4 import mxfp4_weight

    model_dir, _ = tiny_gpt_oss
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    entries = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        entries.update(read_safetensors_header(path))
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            prefix = f"model.layers.{layer}.mlp.experts.{proj}"
            w = mxfp4_weight(prefix, entries[prefix + "_blocks"], entries[prefix + "_scales"])
            assert w.format == "mxfp4" and w.stored().size == MXFP4.nbytes(tuple(w.type.shape))
            theirs = getattr(experts, proj).detach().numpy()               # [E, in, out]
            assert np.array_equal(w.numpy_f32(), theirs.transpose(0, 2, 1))
    logits = model(torch.tensor([[1, 5, 9, 30]])).logits
    assert logits.shape == (1, 4, 512) and bool(torch.isfinite(logits).all())


def test_gguf_holds_the_same_weights(tiny_gpt_oss) -> None:
    gguf = pytest.importorskip("gguf")
    from infeng_common.safetensors import read_safetensors_header
    from infeng_compiler.frontends.mxfp4 import mxfp4_weight

    model_dir, path = tiny_gpt_oss
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    Q = gguf.GGMLQuantizationType
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
    assert reader.fields["gpt-oss.expert_count"].contents() == 4
    assert reader.fields["gpt-oss.attention.sliding_window"].contents() == 4
    assert reader.fields["gpt-oss.rope.scaling.factor"].contents() == 32.0
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 512
    assert tensors["token_embd.weight"].tensor_type == Q.BF16 and list(tensors["token_embd.weight"].shape) == [64, 512]
    assert tensors["blk.0.attn_q.weight"].tensor_type == Q.BF16
    assert tensors["blk.0.attn_sinks.weight"].tensor_type == Q.F32 and tensors["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    entries = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        entries.update(read_safetensors_header(f))
    prefix = "model.layers.1.mlp.experts."
    gate_up = mxfp4_weight("gu", entries[prefix + "gate_up_proj_blocks"], entries[prefix + "gate_up_proj_scales"]).numpy_f32()
    down = mxfp4_weight("d", entries[prefix + "down_proj_blocks"], entries[prefix + "down_proj_scales"]).numpy_f32()
    for name, ours in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]), ("down", down)):
        t = tensors[f"blk.1.ffn_{name}_exps.weight"]
        assert t.tensor_type == Q.MXFP4 and list(t.shape) == [ours.shape[2], ours.shape[1], ours.shape[0]]
        theirs = gguf.quants.dequantize(np.asarray(t.data), Q.MXFP4).reshape(ours.shape)
        assert np.array_equal(theirs, ours), name


def test_gguf_runs_in_llama_bench(tiny_gpt_oss) -> None:
    bench = Path.home() / ".cache/infeng-peers/llama.cpp/build/bin/llama-bench"
    if not bench.is_file() and shutil.which("llama-bench") is None:
        pytest.skip("llama.cpp's llama-bench is not built on this host")
    out = subprocess.run([str(bench) if bench.is_file() else "llama-bench", "-m", str(tiny_gpt_oss[1]), "-t", "2",
                          "-p", "16", "-n", "4", "-r", "1", "-o", "json"], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gpt-oss" in out.stdout and "MXFP4" in out.stdout


def test_tiny_checkpoint_matches_transformers(tiny_gpt_oss, tmp_path) -> None:
    """The MXFP4 experts read as they are, interpreted and compiled, against transformers on its
    dequantized MXFP4 (f32): logits of a prefill and of decode steps within 1e-4 x max |logit|."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_compiler.frontends.hf import import_hf
    from infeng_compiler.interp import Interpreter
    from infeng_runtime.engine import Engine

    model_dir, _ = tiny_gpt_oss
    ids = np.array([1, 45, 300, 12, 7, 99, 250, 3, 60, 411, 5, 17], np.int32)    # past the window of 4
    n = len(ids)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor(ids[None])).logits[0].numpy()
    graph = import_hf(model_dir)
    assert graph.weights["model.layers.0.mlp.experts.gate_up_proj"].format == "mxfp4"
    interp = Interpreter(graph).step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    assert rel_err(interp, ref) < 1e-4
    out = tmp_path / "m.infeng"
    compile_model(model_dir, out, CompileOptions())
    engine = Engine(out, max_seqs=2)
    assert rel_err(engine.step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32)), ref) < 1e-4
    steps = [engine.step(ids[i:i + 1], np.array([i], np.int32), np.array([1], np.int32)) for i in range(n)]
    assert rel_err(np.concatenate(steps), ref) < 1e-4


def test_all_finite_without_dequantizing() -> None:
    """Only an e8m0 scale of 0xFF (2^128) times an e2m1 code of magnitude 1 or more is not finite
    (+-0 and +-0.5 stay finite); it agrees with the dequantized values, which ``infeng compile`` no
    longer computes for MXFP4 weights."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (3, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 2), dtype=np.uint8)
    for top_codes in (None, 0x00, 0x88, 0x91, 0x02, 0x30):
        b, s = blocks.copy(), scales.copy()
        if top_codes is not None:
            s[1, 0] = 0xFF
            b[1, 0] = top_codes            # +-0 and +-0.5 only (0x00, 0x88, 0x91); a 1.0 (0x02, 0x30)
        qt = mxfp4_tensor(b, s)
        with np.errstate(over="ignore"):
            expected = bool(np.isfinite(MXFP4.dequantize(qt)).all())
        assert MXFP4.all_finite(qt) == expected == (top_codes not in (0x02, 0x30)), top_codes

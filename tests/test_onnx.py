"""ONNX frontend end to end: models exported with torch's dynamo exporter (no KV cache,
full-sequence logits, dynamic length) are imported, folded, raised to the transformer ops of the
Hugging Face path, compiled, and checked against transformers.

Tolerances: the compiled ONNX artifact against transformers, max abs error <= 1e-4 * max|logit|
(the same bound as the Hugging Face path: f32 weights, accumulation order only); stories260K's
perplexity within 0.05% of BENCHMARKS' 143.13.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("onnxscript")

from infeng_common.errors import UnsupportedError  # noqa: E402
from infeng_cli.main import app  # noqa: E402
from infeng_compiler.compile import CompileOptions, compile_model  # noqa: E402
from infeng_compiler.frontends import import_model, require_raised  # noqa: E402
from infeng_compiler.frontends.onnx import load_onnx  # noqa: E402
from infeng_compiler.interp import Interpreter  # noqa: E402
from infeng_compiler.ir.ops import PRIMITIVE_OPS  # noqa: E402
from infeng_compiler.passes.manager import PassManager, parse_pipeline  # noqa: E402
from infeng_runtime.engine import Engine  # noqa: E402

MODELS = ("llama", "gpt2", "stories260K")
PROMPT = [1, 17, 33, 5, 90, 11, 7, 64, 3, 2, 100]


@pytest.fixture(scope="session")
def model_dir(hf_checkpoint, stories_dir):
    return lambda name: stories_dir if name == "stories260K" else hf_checkpoint(name)


@pytest.fixture(scope="session")
def onnx_model(tmp_path_factory, model_dir):
    """``onnx_model(name)``: the model exported once per session with torch.onnx.export(dynamo=True)."""
    from infeng_models.onnx_export import export_onnx

    root = tmp_path_factory.mktemp("onnx")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = export_onnx(model_dir(name), root / name / f"{name}.onnx")
        return done[name]

    return get


@pytest.fixture(scope="session")
def onnx_artifact(tmp_path_factory, onnx_model, model_dir):
    root = tmp_path_factory.mktemp("onnx-artifacts")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = root / f"{name}.infeng"
            compile_model(onnx_model(name), out, CompileOptions(target="native", tokenizer=model_dir(name)))
            done[name] = out
        return done[name]

    return get


def transformers_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


@pytest.mark.parametrize("name", MODELS)
def test_raised_graph_is_the_transformer_graph(onnx_model, model_dir, name):
    graph = import_model(onnx_model(name), model_dir(name))
    ops = {n.op for n in graph.nodes}
    assert not ops & PRIMITIVE_OPS, f"primitive ops left: {sorted(ops & PRIMITIVE_OPS)}"
    assert ({"rms_norm"} if name != "gpt2" else {"layer_norm"}) <= ops
    assert {"embedding", "linear", "attention", "logits", "add"} <= ops
    assert ({"rope", "silu_mul"} if name != "gpt2" else {"gelu", "split"}) <= ops
    assert all(w.type.rank == 1 or n.op in ("linear", "logits", "embedding") for n in graph.nodes for w in n.weights)
    assert graph.inputs[0].name == "tokens" and graph.outputs[0].type.shape[0] == "R"
    attn = [n for n in graph.find("attention")]
    assert [n.attrs["layer"] for n in attn] == list(range(len(attn)))
    rope = [n for n in graph.find("rope")]
    assert all(n.attrs["theta"] == 10000.0 and "inv_freq" not in n.attrs for n in rope)


@pytest.mark.parametrize("name", MODELS)
def test_compiled_onnx_matches_transformers(onnx_artifact, model_dir, name):
    """Prefill every row, then decode greedily; each step against transformers' full forward."""
    engine = Engine(onnx_artifact(name))
    ids = list(PROMPT)
    got = [engine.step(np.array(ids), np.arange(len(ids)), np.zeros(len(ids)))]
    for _ in range(3):
        ids.append(int(got[-1][-1].argmax()))
        got.append(engine.step(np.array(ids[-1:]), np.array([len(ids) - 1]), np.zeros(1)))
    want = transformers_logits(model_dir(name), ids)
    rows = [want[: len(PROMPT)]] + [want[len(PROMPT) + i: len(PROMPT) + i + 1] for i in range(3)]
    for step, (g, w) in enumerate(zip(got, rows)):
        err, bound = np.abs(g - w).max(), 1e-4 * np.abs(w).max()
        assert err <= bound, f"step {step}: max abs error {err:.3g} > {bound:.3g}"


def test_primitive_graph_interprets_like_transformers(onnx_model, model_dir):
    """The imported graph before raising, run by the interpreter (one full sequence)."""
    graph = load_onnx(onnx_model("llama"))
    got = Interpreter(graph).step(np.array(PROMPT), np.arange(len(PROMPT)), np.zeros(len(PROMPT)))[0]
    want = transformers_logits(model_dir("llama"), PROMPT)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_fold_shapes_keeps_the_length_symbolic(onnx_model):
    graph = load_onnx(onnx_model("llama"))
    PassManager(parse_pipeline("fold-shapes")).run(graph)
    shapes = [n.attrs["value"] for n in graph.find("const") if isinstance(n.attrs.get("value"), list)
              and "T" in n.attrs["value"]]
    assert shapes, "no reshape target was folded to a symbolic constant"
    assert not any(n.op in ("shape", "concat") and n.outputs[0].type.rank == 1 and n.outputs[0].type.dtype == "i64"
                   for n in graph.nodes), "shape arithmetic left unfolded"
    with pytest.raises(UnsupportedError, match=r"matmul x\d+"):
        require_raised(graph, "llama.onnx")


def test_stories260k_onnx_perplexity(onnx_artifact, assets):
    result = CliRunner().invoke(app, ["eval", str(onnx_artifact("stories260K")), "--ppl",
                                      str(assets / "text/wikitext-2-raw-v1-test.txt"), "--max-bytes", "100000",
                                      "--ctx", "256", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "compiled" and report["chunks"] == 247
    assert abs(report["ppl"] - 143.13) / 143.13 <= 5e-4


def test_cli_ir_after_raise_and_onnx_export(onnx_model, model_dir, tmp_path):
    import onnx

    model = str(onnx_model("gpt2"))
    result = CliRunner().invoke(app, ["ir", model, "--after", "raise"])
    assert result.exit_code == 0, result.output
    assert "= attention(" in result.stdout and "= layer_norm(" in result.stdout and "matmul(" not in result.stdout
    result = CliRunner().invoke(app, ["ir", model, "--after", "all"])
    assert [ln for ln in result.stdout.splitlines() if ln.startswith("# after")] == \
        ["# after import", "# after fold-shapes", "# after raise", "# after cast-weights", "# after fuse-linears",
         "# after plan-memory", "# after lower"]
    for source, name in ((model, "raised.onnx"), (str(model_dir("llama")), "hf.onnx")):
        result = CliRunner().invoke(app, ["ir", source, "--format", "onnx", "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        exported = onnx.load(str(tmp_path / name))
        onnx.checker.check_model(exported)
        assert {n.op_type for n in exported.graph.node if n.domain == "ai.infeng"} >= {"attention", "logits"}
    result = CliRunner().invoke(app, ["ir", model, "--after", "nope"])
    assert result.exit_code == 2 and "fold-shapes, raise" in result.output


def test_compile_cli_with_tokenizer(onnx_model, model_dir, tmp_path):
    out = tmp_path / "gpt2.infeng"
    result = CliRunner().invoke(app, ["compile", str(onnx_model("gpt2")), "--tokenizer", str(model_dir("gpt2")),
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["import_pipeline"] == "fold-shapes,raise"
    assert set(manifest["source"]["sha256"]) == {"gpt2.onnx", "gpt2.onnx.data"}


def test_unsupported_ops_are_listed_together(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
             helper.make_node("LSTM", ["h", "w", "r"], ["y"]),
             helper.make_node("Conv", ["y", "k"], ["z"]),
             helper.make_node("Conv", ["z", "k"], ["logits"])]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              initializer=[helper.make_tensor("table", TensorProto.FLOAT, [4, 2], [0.0] * 8)])
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(UnsupportedError, match=r"2 ONNX operator\(s\) not supported: Conv \(x2\), LSTM \(x1\)"):
        load_onnx(path)
    result = CliRunner().invoke(app, ["ir", str(path)])
    assert result.exit_code == 2 and "Conv (x2), LSTM (x1)" in result.output and "Traceback" not in result.output

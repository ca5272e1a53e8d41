"""The IR: text round trip, the printed form, the verifier, JSON/DOT views, lazy weights."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from conftest import HF_VARIANTS

from infeng_common.errors import IRError
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.ir import Graph, TensorType, Weight, parse, print_graph, verify
from infeng_compiler.ir.serialize import from_json, to_dot, to_json

CHECKPOINTS = list(HF_VARIANTS) + ["stories260K"]


@pytest.fixture(scope="module")
def graph_of(hf_checkpoint, stories_dir):
    def get(name: str) -> Graph:
        return import_hf(stories_dir if name == "stories260K" else hf_checkpoint(name))

    return get


# ---------------------------------------------------------------------------------------------
# text form
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_parse_print_round_trip(graph_of, name: str) -> None:
    g = graph_of(name)
    text = print_graph(g)
    again = parse(text)
    assert again == g
    assert print_graph(again) == text


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_one_line_per_node_with_types(graph_of, name: str) -> None:
    g = graph_of(name)
    lines = print_graph(g).splitlines()
    node_lines = [ln for ln in lines if re.match(r"^\s*%", ln)]
    assert len(node_lines) == len(g.nodes)
    value_type = r"(?:f32|f16|bf16|i32|i64)\[[\w,]*\]"
    for ln, node in zip(node_lines, g.nodes):
        m = re.match(rf"^\s*(%[\w.\-]+(?:, %[\w.\-]+)*) = (\w+)\((.*?)\) : ({value_type}(?:, {value_type})*)", ln)
        assert m, ln
        assert m.group(2) == node.op
        assert m.group(4).split(", ") == [str(v.type) for v in node.outputs]
    weight_lines = [ln for ln in lines if ln.strip().startswith("weight @")]
    assert len(weight_lines) == len(g.weights)
    for ln in weight_lines:
        assert re.match(rf"^\s*weight @[\w.\-]+ : {value_type} \{{file=\"[^\"]+\", offset=\d+", ln), ln
    assert lines[0].startswith("graph @") and "%tokens: i32[T]" in lines[0] and "%positions: i32[T]" in lines[0]
    assert lines[-2].strip() == "return %logits"


def test_gpt2_transposed_weights_round_trip(graph_of) -> None:
    g = graph_of("gpt2")
    w = g.weights["transformer.h.0.attn.c_attn.weight"]
    assert w.transposed and w.type.shape == (192, 64)
    assert "transposed=true" in print_graph(g)
    assert parse(print_graph(g)).weights[w.name].transposed


SMALL = """
graph @small(%tokens: i32[T], %positions: i32[T]) {
  weight @emb : f32[16,8] {inline=true}
  weight @w : f32[4,8] {inline=true}
  %h = embedding(%tokens, @emb) : f32[T,8]
  %y = linear(%h, @w) : f32[T,4]
  return %y
}
"""


def small_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((16, 8), dtype=np.float32), "w": rng.standard_normal((4, 8), dtype=np.float32)}


def test_small_graph_parses_and_round_trips() -> None:
    g = parse(SMALL, small_arrays())
    assert [n.op for n in g.nodes] == ["embedding", "linear"]
    assert parse(print_graph(g), small_arrays()) == g


@pytest.mark.parametrize("text, message", [
    (SMALL.replace("%h = embedding(%tokens, @emb) : f32[T,8]\n  %y = linear(%h, @w) : f32[T,4]",
                   "%y = linear(%h, @w) : f32[T,4]\n  %h = embedding(%tokens, @emb) : f32[T,8]"),
     "used before it is defined"),
    (SMALL.replace("return %y", "return %z"), "used before it is defined"),
    (SMALL.replace("linear(%h, @w) : f32[T,4]", "linear(%h, @w) : f32[T,5]"), "shape rule gives"),
    (SMALL.replace("weight @w : f32[4,8]", "weight @w : f32[4,9]"), "does not match"),
    (SMALL.replace("embedding(%tokens, @emb)", "embedding(%positions, @emb, @w)"), "takes weights"),
    (SMALL.replace("linear(%h, @w)", "linear(%h, @nope)"), "not declared"),
    (SMALL.replace("%y = linear", "%h = linear"), "defined twice"),
    (SMALL.replace("linear(", "matmul_nope("), "unknown op"),
    (SMALL.replace("f32[T,4]", "f32[Q,4]"), "unknown symbolic dimension"),
    (SMALL.replace("f32[T,4]", "q7[T,4]"), "unknown element type"),
    (SMALL.replace("graph @small", "graf @small"), "expected 'graph @name"),
    ("", "empty IR text"),
])
def test_parser_and_verifier_reject_malformed_text(text: str, message: str) -> None:
    with pytest.raises(IRError, match=re.escape(message)):
        parse(text, small_arrays())


def test_verifier_rejects_malformed_graphs() -> None:
    def fresh() -> Graph:
        return parse(SMALL, small_arrays())

    g = fresh()
    g.nodes.reverse()                                     # use before def
    with pytest.raises(IRError, match="not defined before use"):
        verify(g)

    g = fresh()
    g.nodes[1].outputs[0].type = TensorType("f32", ("T", 3))  # result type the shape rule disagrees with
    with pytest.raises(IRError, match="shape rule gives"):
        verify(g)

    g = fresh()
    g.nodes[1].weights = [Weight("w", TensorType("f32", (4, 8)), array=np.zeros((4, 8), np.float32))]
    with pytest.raises(IRError, match="not declared in the graph"):   # a weight object not in g.weights
        verify(g)

    g = fresh()
    g.nodes[0].attrs["bogus"] = 1
    verify(g)                                             # extra attributes are allowed ...
    g = fresh()
    g.nodes.append(g.nodes[0])                            # ... redefining a value is not
    with pytest.raises(IRError, match="defined twice"):
        verify(g)

    g = fresh()
    with pytest.raises(IRError, match="missing attributes"):
        g.add_node("rms_norm", [g.nodes[0].output], [g.weights["w"]])


def test_verifier_rejects_wrong_model_shapes(graph_of) -> None:
    g = graph_of("llama")
    attn = next(g.find("attention"))
    attn.attrs["n_heads"] = 3
    with pytest.raises(IRError, match="attention"):
        verify(g)


# ---------------------------------------------------------------------------------------------
# JSON and DOT
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_json_round_trip(graph_of, name: str) -> None:
    g = graph_of(name)
    text = to_json(g)
    json.loads(text)
    assert from_json(text) == g


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dot_export(graph_of, name: str) -> None:
    g = graph_of(name)
    dot = to_dot(g)
    nxg = g.to_networkx()
    lines = dot.strip().splitlines()
    assert lines[0].startswith("digraph") and lines[-1] == "}"
    vertices = [ln for ln in lines if re.match(r'^\s*"[^"]+" \[', ln)]
    edges = [re.match(r'^\s*"([^"]+)" -> "([^"]+)"', ln) for ln in lines if "->" in ln]
    assert len(vertices) == nxg.number_of_nodes()
    assert {(m.group(1), m.group(2)) for m in edges} == set(nxg.edges())
    assert nx.is_directed_acyclic_graph(nxg)
    ops = [ln for ln in vertices if "shape=box" in ln]
    assert len(ops) == len(g.nodes)


def test_cli_ir_prints_the_graph(hf_checkpoint, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from infeng_cli.main import app

    model = hf_checkpoint("qwen2")
    runner = CliRunner()
    result = runner.invoke(app, ["ir", str(model)])
    assert result.exit_code == 0, result.output
    assert parse(result.stdout) == import_hf(model)
    result = runner.invoke(app, ["ir", str(model), "--format", "json", "-o", str(tmp_path / "g.json")])
    assert result.exit_code == 0, result.output
    assert from_json((tmp_path / "g.json").read_text()) == import_hf(model)
    result = runner.invoke(app, ["ir", str(model), "--format", "dot"])
    assert result.exit_code == 0 and result.stdout.startswith("digraph")


# ---------------------------------------------------------------------------------------------
# importing does not read weights
def write_sparse_checkpoint(out: Path) -> int:
    """A ~200 MB f16 llama checkpoint whose data is a sparse hole (instant to write); returns its size."""
    from infeng_models.synthetic import make_config, tensor_specs

    config = make_config("llama", hidden=1024, layers=2, heads=8, kv_heads=8, intermediate=4096, vocab=65536,
                         dtype="f16", tie=True)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for spec in tensor_specs(config):
        header[spec.name] = {"dtype": "F16", "shape": list(spec.shape), "data_offsets": [offset, offset + 2 * spec.numel]}
        offset += 2 * spec.numel
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def test_import_reads_no_weights(graph_of) -> None:
    for name in CHECKPOINTS:
        g = graph_of(name)
        print_graph(g), to_json(g)
        assert all(w.array is None and w.file for w in g.weights.values()), name


def test_import_memory_does_not_grow_with_checkpoint(tmp_path: Path) -> None:
    size = write_sparse_checkpoint(tmp_path / "big")
    assert size > 190e6
    probe = textwrap.dedent(r"""
        import re, sys
        from infeng_compiler.frontends.hf import import_hf
        from infeng_compiler.ir import print_graph

        def rss():
            # Peak RSS of this process image. Not getrusage's ru_maxrss: Linux carries the forking
            # parent's peak across exec into it, which would hide growth below the pytest process's size.
            status = open("/proc/self/status").read()
            return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
        before = rss()
        g = import_hf(sys.argv[1])
        print_graph(g)
        after_import = rss()
        g.weights["model.embed_tokens.weight"].numpy_f32()   # control: reading one weight is visible
        print(after_import - before, rss() - after_import)
    """)
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "big")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    import_growth, read_growth = map(int, result.stdout.split())
    assert import_growth < 20e6, f"importing a {size / 1e6:.0f} MB checkpoint grew peak RSS by {import_growth / 1e6:.0f} MB"
    assert read_growth > 100e6, "the control read did not show in RSS: the measurement is blind"


def test_a_weight_prints_its_storage_format_as_its_type() -> None:
    """A 4-bit weight reads q4g32m[...] (its storage), its source element type as ``source``; the text
    parses back to the same graph."""
    g = parse(textwrap.dedent("""\
        graph @m(%tokens: i32[T], %positions: i32[T]) {
          weight @emb : f32[16,8] {inline=true}
          weight @w : q4g32m[16,32] {source="f32", inline=true, prequantized="GGUF Q4_1"}
          %h = embedding(%tokens, @emb) : f32[T,8]
          return %h
        }
        """), arrays={"emb": np.zeros((16, 8), np.float32), "w": np.zeros((16, 32), np.float32)})
    w = g.weights["w"]
    assert w.type == TensorType("f32", (16, 32)) and w.format == "q4g32m"
    text = print_graph(g)
    assert 'weight @w : q4g32m[16,32] {source="f32", inline=true, prequantized="GGUF Q4_1"}' in text
    assert "format=" not in text
    assert print_graph(parse(text, arrays={"emb": g.weights["emb"].array, "w": w.array})) == text


def test_the_ir_imports_nothing_from_quant() -> None:
    """DESIGN §2: formats own their quantization and register what they add (ir/storage.py);
    no module of ir/ imports quant/, so there is no cycle between them."""
    import ast
    from pathlib import Path

    import infeng_compiler.ir as ir_package

    for path in sorted(Path(ir_package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not name.startswith("..quant") and not name.startswith("infeng_compiler.quant"), \
                    f"ir/{path.name} imports {name}"
    from infeng_compiler.ir import storage

    assert storage.weights().is_quantized("q4g32") and not storage.weights().is_quantized("f16")

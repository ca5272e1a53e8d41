"""Every registered pass, as XLA tests its HLO passes: IR text in, ``CHECK:`` lines out (for the
passes whose text tests live here; ``quantize``, ``fuse-linears``, ``kv-format`` and ``fht-kv``
have theirs in test_quant_pass.py, test_fuse_linears.py and test_kv_cache.py), and one test over
the pass registry that runs each pass on the real stories260K graph and checks, with the
interpreter before and after, that the logits move by no more than the pass declares.

The registry test is parametrized by the registry itself: a pass registered without a case in
``REGISTRY_CASES`` fails it, so every new pass gets covered.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from infeng_common.errors import InfengError
from infeng_common.peft import LoraAdapter, LoraModule
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir import Graph, parse, print_graph
from infeng_compiler.passes import catalogue
from infeng_compiler.passes.catalogue import PASSES
from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline

#: in-domain text for stories260K (TinyStories): logits of a trained model on its own kind of text
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def run(graph: Graph, pipeline: str, ctx: PassContext | None = None) -> Graph:
    PassManager(parse_pipeline(pipeline)).run(graph, ctx)
    return graph


def assert_ir(text: str, checks: str) -> None:
    """FileCheck-style: each ``CHECK:`` line occurs, in order, as a substring of a line of ``text``;
    no line of ``text`` contains a ``CHECK-NOT:`` string."""
    lines = text.splitlines()
    i = 0
    for line in (c.strip() for c in checks.strip().splitlines()):
        if line.startswith("CHECK-NOT:"):
            banned = line.removeprefix("CHECK-NOT:").strip()
            assert not any(banned in ln for ln in lines), f"found: {banned}\n{text}"
        elif line.startswith("CHECK:"):
            want = line.removeprefix("CHECK:").strip()
            while i < len(lines) and want not in lines[i]:
                i += 1
            assert i < len(lines), f"not found (in order): {want}\n{text}"
            i += 1


def rel_change(before: np.ndarray, after: np.ndarray) -> float:
    return float(np.abs(after - before).max() / np.abs(before).max())


# ---------------------------------------------------------------------------------------------
# IR text in, CHECK lines out
MLP = """
graph @mlp(%tokens: i32[T], %positions: i32[T]) {
  meta {"vocab_size": 32}
  weight @emb : f32[32,16] {inline=true}
  weight @norm : f32[16] {inline=true}
  weight @l0.q_proj.weight : f32[16,16] {inline=true}
  weight @l0.up_proj.weight : f32[16,16] {inline=true}
  %h = embedding(%tokens, @emb) : f32[T,16]
  %n = rms_norm(%h, @norm) : f32[T,16] {eps=1e-05}
  %q = linear(%n, @l0.q_proj.weight) : f32[T,16]
  %u = linear(%q, @l0.up_proj.weight) : f32[T,16]
  %logits = logits(%u, @emb) : f32[R,32]
  return %logits
}
"""


def mlp_graph() -> Graph:
    rng = np.random.default_rng(0)
    shapes = {"emb": (32, 16), "norm": (16,), "l0.q_proj.weight": (16, 16), "l0.up_proj.weight": (16, 16)}
    return parse(MLP, {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()})


def mlp_logits(graph: Graph, adapter: LoraAdapter | None = None) -> np.ndarray:
    tokens = np.array([1, 5, 9, 30, 2, 17], np.int32) % graph.meta["vocab_size"]
    interpreter = Interpreter(graph)
    slots = None
    if adapter is not None:
        interpreter.load_adapter(0, adapter)
        slots = np.zeros(len(tokens), np.int32)
    return interpreter.step(tokens, np.arange(len(tokens)), np.zeros(len(tokens)), adapter_slots=slots)


def test_cast_weights_sets_the_storage_format_of_matrices_only() -> None:
    after = run(mlp_graph(), "cast-weights(f16)")
    assert_ir(print_graph(after), """
    CHECK: weight @emb : f16[32,16] {source="f32", inline=true}
    CHECK: weight @norm : f32[16] {inline=true}
    CHECK: weight @l0.q_proj.weight : f16[16,16] {source="f32", inline=true}
    CHECK: %q = linear(%n, @l0.q_proj.weight) : f32[T,16]
    CHECK-NOT: @norm : f16
    """)
    assert 0 < rel_change(mlp_logits(mlp_graph()), mlp_logits(after)) <= PASSES["cast-weights"]("f16").tolerance
    with pytest.raises(InfengError, match="cast-weights: dtype must be one of f32, f16, bf16"):
        run(mlp_graph(), "cast-weights(f8)")


def lora_adapter(graph: Graph, name: str = "a", rank: int = 2) -> LoraAdapter:
    """A rank-``rank`` adapter on q_proj with random A and B (delta about 10% of W)."""
    rng = np.random.default_rng(1)
    out, inp = graph.weights["l0.q_proj.weight"].type.shape
    module = LoraModule("l0.q_proj.weight", (0.3 * rng.standard_normal((rank, inp))).astype(np.float32),
                        (0.3 * rng.standard_normal((out, rank))).astype(np.float32), 0.5)
    return LoraAdapter(name, Path(name), {"r": rank}, {"l0.q_proj.weight": module})


def test_lora_slots_turns_targeted_linears_into_lora_linears() -> None:
    after = run(mlp_graph(), "lora-slots(2,4,q_proj)")
    assert_ir(print_graph(after), """
    CHECK: graph @mlp(%tokens: i32[T], %positions: i32[T], %adapter_slots: i32[T])
    CHECK: %q = lora_linear(%n, %adapter_slots, @l0.q_proj.weight) : f32[T,16] {site=0, target="l0.q_proj.weight", max_adapters=2, max_rank=4}
    CHECK: %u = linear(%q, @l0.up_proj.weight) : f32[T,16]
    """)
    assert rel_change(mlp_logits(mlp_graph()), mlp_logits(after)) == 0.0      # no adapter loaded


def test_merge_lora_folds_the_adapter_into_the_weight() -> None:
    g = mlp_graph()
    adapter = lora_adapter(g)
    after = run(g, "merge-lora(a)", PassContext(adapters={"a": adapter}))
    assert_ir(print_graph(after), """
    CHECK: weight @l0.q_proj.weight+a : f32[16,16] {inline=true}
    CHECK: %q = linear(%n, @l0.q_proj.weight+a) : f32[T,16]
    CHECK: %u = linear(%q, @l0.up_proj.weight) : f32[T,16]
    CHECK-NOT: weight @l0.q_proj.weight :
    """)
    slotted = run(mlp_graph(), "lora-slots(1,2,q_proj)")
    assert rel_change(mlp_logits(slotted, adapter), mlp_logits(after)) <= PASSES["merge-lora"]("a").tolerance
    with pytest.raises(InfengError, match="merge-lora: no adapter named 'b'"):
        run(mlp_graph(), "merge-lora(b)", PassContext(adapters={"a": adapter}))


PRIMITIVE = """
graph @prim(%tokens: i32[T], %positions: i32[T]) {
  meta {"vocab_size": 16}
  weight @emb : f32[16,8] {inline=true}
  weight @w : f32[8,16] {inline=true}
  %emb = const(@emb) : f32[16,8]
  %h = gather(%emb, %tokens) : f32[T,8]
  %s = shape(%h) : i64[2]
  %r = reshape(%h, %s) : f32[T,8]
  %dead = mul(%r, %r) : f32[T,8]
  %wc = const(@w) : f32[8,16]
  %logits = matmul(%r, %wc) : f32[T,16]
  return %logits
}
"""


def primitive_graph() -> Graph:
    rng = np.random.default_rng(2)
    return parse(PRIMITIVE, {"emb": rng.standard_normal((16, 8)).astype(np.float32),
                             "w": rng.standard_normal((8, 16)).astype(np.float32)})


def test_dce_removes_what_nobody_reads() -> None:
    assert_ir(print_graph(run(primitive_graph(), "dce")), """
    CHECK: %r = reshape(%h, %s) : f32[T,8]
    CHECK: %logits = matmul(%r, %wc) : f32[T,16]
    CHECK-NOT: %dead
    """)


def test_fold_shapes_keeps_the_length_symbolic() -> None:
    after = run(primitive_graph(), "fold-shapes")
    assert_ir(print_graph(after), """
    CHECK: %h = gather(%emb, %tokens) : f32[T,8]
    CHECK: %s.c = const() : i64[2] {value=["T", 8], dtype="i64"}
    CHECK: %r = reshape(%h, %s.c) : f32[T,8]
    CHECK-NOT: = shape(
    """)
    assert rel_change(mlp_logits(primitive_graph()), mlp_logits(after)) == 0.0


def test_raise_turns_primitives_into_transformer_ops() -> None:
    after = run(primitive_graph(), "fold-shapes,raise")
    assert_ir(print_graph(after), """
    CHECK: weight @w.t : f32[16,8] {inline=true, transposed=true}
    CHECK: %embed = embedding(%tokens, @emb) : f32[T,8]
    CHECK: %logits.1 = logits(%embed, @w.t) : f32[R,16]
    CHECK: return %logits.1
    CHECK-NOT: matmul(
    CHECK-NOT: gather(
    """)
    assert after.meta["raised"] == {"embedding": 1, "logits": 1}
    assert rel_change(mlp_logits(primitive_graph()), mlp_logits(after)) <= PASSES["raise"]().tolerance


def test_the_observer_sees_every_node_once_in_order() -> None:
    g = mlp_graph()
    seen: list[tuple[str, list[np.ndarray], list[np.ndarray]]] = []
    logits = Interpreter(g, lambda node, ins, ws, outs: seen.append((node.op, ins, outs))).step(
        np.array([1, 2, 3]), np.arange(3), np.zeros(3))
    assert [op for op, _, _ in seen] == [n.op for n in g.nodes]
    assert seen[-1][2][0] is logits and seen[1][1][0] is seen[0][2][0]     # results flow to readers


# ---------------------------------------------------------------------------------------------
# every registered pass on stories260K, the interpreter before and after
@dataclass
class RegistryCase:
    """How the registry test runs one pass: its pipeline entry (``{calib}``: the calibration text),
    the passes run first on the graph both sides see, and which graph it starts from."""

    entry: str
    setup: str = ""
    onnx: bool = False        # stories260K exported to ONNX and imported without raising
    adapter: bool = False     # before: the adapter applied in a LoRA slot (merge-lora's reference)
    changes: bool = True      # whether the pass changes this graph


CALIB = "calib={calib},calib_max_bytes=12000,calib_ctx=128"
REGISTRY_CASES = {
    "cast-weights": RegistryCase("cast-weights(bf16)"),
    "merge-lora": RegistryCase("merge-lora(story)", adapter=True),
    "lora-slots": RegistryCase("lora-slots(4,8)"),
    "fht-kv": RegistryCase("fht-kv"),
    "kv-format": RegistryCase(f"kv-format(int8,{CALIB})", setup="fht-kv"),
    "quantize": RegistryCase(f"quantize(int4,{CALIB})"),
    "act-precision": RegistryCase("act-precision(f32)", setup="quantize(int4)"),
    "fuse-linears": RegistryCase("fuse-linears"),
    "dce": RegistryCase("dce", onnx=True, changes=False),      # the export has no dead code
    "fold-shapes": RegistryCase("fold-shapes", onnx=True),
    "raise": RegistryCase("raise", setup="fold-shapes", onnx=True),
    # stories260K has no experts: the pass must leave it exact (MoE numerics: test_moe.py)
    "experts-act": RegistryCase("experts-act(q8)", changes=False),
    "plan-memory": RegistryCase("plan-memory"),          # records the plan; no value changes
}


@pytest.fixture(scope="module")
def story_ids(stories_dir) -> np.ndarray:
    from infeng_common.tokenizer import Tokenizer

    return np.array(Tokenizer(stories_dir, 1, [2]).encode(STORY, add_bos=True), np.int32)


@pytest.fixture(scope="module")
def stories_onnx(tmp_path_factory, stories_dir) -> Path:
    from infeng_models.onnx_export import export_onnx

    return export_onnx(stories_dir, tmp_path_factory.mktemp("onnx") / "stories260K.onnx")


def story_adapter(graph: Graph) -> LoraAdapter:
    """Rank-4 deltas on every layer's q_proj and v_proj, about 10% of each weight."""
    rng = np.random.default_rng(5)
    modules = {}
    for name, w in graph.weights.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            out, inp = w.type.shape
            A = rng.standard_normal((4, inp)).astype(np.float32) / np.sqrt(inp)
            B = (0.1 * np.abs(w.numpy_f32()).mean() * rng.standard_normal((out, 4))).astype(np.float32)
            modules[name] = LoraModule(name, A, B, 2.0)
    return LoraAdapter("story", Path("story"), {"r": 4}, modules)


@pytest.mark.parametrize("name", sorted(PASSES))
def test_registered_pass_within_its_tolerance_on_stories260k(name, stories_dir, assets, story_ids, request) -> None:
    assert name in REGISTRY_CASES, f"pass {name!r} is registered but has no case in REGISTRY_CASES (test_passes.py)"
    case = REGISTRY_CASES[name]
    calib = assets / "text" / "wikitext-2-raw-v1-test.txt"
    ctx = PassContext(model_dir=stories_dir)

    def start() -> Graph:
        if case.onnx:
            from infeng_compiler.frontends.onnx import load_onnx

            graph = load_onnx(request.getfixturevalue("stories_onnx"))
        else:
            graph = import_hf(stories_dir)
        return run(graph, case.setup, ctx) if case.setup else graph

    tokens, positions, seqs = story_ids, np.arange(len(story_ids)), np.zeros(len(story_ids))
    if case.adapter:
        adapter = story_adapter(import_hf(stories_dir))
        ctx.adapters = {adapter.name: adapter}
        reference = Interpreter(run(start(), "lora-slots(1,4)"))
        reference.load_adapter(0, adapter)
        before = reference.step(tokens, positions, seqs, adapter_slots=np.zeros(len(tokens), np.int32))
    else:
        before = Interpreter(start()).step(tokens, positions, seqs)
    graph = start()
    manager = PassManager(parse_pipeline(case.entry.format(calib=calib)))
    manager.run(graph, ctx)
    after = Interpreter(graph).step(tokens, positions, seqs)
    record = manager.records[0]
    assert record.name == name and record.changed == case.changes, (name, record.changed)
    assert rel_change(before, after) <= record.tolerance, (name, rel_change(before, after), record.tolerance)


def test_registry_cases_name_only_registered_passes() -> None:
    assert set(REGISTRY_CASES) <= set(PASSES), set(REGISTRY_CASES) - set(PASSES)


def test_the_compile_pipeline_lists_every_pass_it_runs() -> None:
    """The pipeline is data and no pass runs another: --kv fht-int8 is two entries, in order."""
    from infeng_compiler.compile import CompileOptions

    assert CompileOptions(kv="fht-int8", kv_window=16, quant="int4").pipeline() == [
        ("fht-kv", []), ("kv-format", ["int8", "window=16"]), ("cast-weights", ["f32"]), ("quantize", ["int4"]),
        ("fuse-linears", []), ("plan-memory", [])]


def test_no_pass_imports_a_frontend() -> None:
    """DESIGN §2: passes build on ir/, quant/ and the interpreter; a frontend is never imported."""
    for path in sorted(Path(catalogue.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not name.startswith("..frontends") and not name.startswith("infeng_compiler.frontends"), \
                    f"{path.name} imports {name}"


def test_build_pipeline_returns_named_phases() -> None:
    """docs/ir.md: model rewrites, then storage formats, then fusion, then the memory plan; every
    phase present, an empty one too; an explicit --passes falls into phases by the pass table."""
    from infeng_compiler.compile import CompileOptions
    from infeng_compiler.passes.manager import phases_of
    from infeng_compiler.passes.pipeline import COMPILE_PHASES, build_pipeline

    phases = build_pipeline(CompileOptions(kv="fht-int8", quant="int4", max_adapters=2))
    assert [p.name for p in phases] == list(COMPILE_PHASES) == ["model", "storage", "fusion", "memory"]
    assert [[n for n, _ in p.entries] for p in phases] == [
        ["lora-slots"], ["fht-kv", "kv-format", "cast-weights", "quantize"], ["fuse-linears"], ["plan-memory"]]
    explicit = phases_of(parse_pipeline("cast-weights(f16),fuse-linears,quantize(int8)"))
    assert [(p.name, [n for n, _ in p.entries]) for p in explicit] == [
        ("storage", ["cast-weights"]), ("fusion", ["fuse-linears"]), ("storage", ["quantize"])]


def test_the_pass_table_lists_every_pass_class_and_nothing_registers_itself() -> None:
    """An explicit table (passes/catalogue.py), not registration by import side effect."""
    from infeng_compiler.passes.catalogue import PASS_TABLE, PHASES

    assert all(info.phase in PHASES for info in PASS_TABLE.values())
    for path in sorted(Path(catalogue.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert "@register" not in text, f"{path.name} registers a pass by decorator"
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            named = [b.value.value for b in node.body if isinstance(b, ast.Assign) and isinstance(b.value, ast.Constant)
                     and [getattr(t, "id", "") for t in b.targets] == ["name"]]      # a pass: name = "..."
            for name in named:
                assert name in PASS_TABLE and PASS_TABLE[name].factory.__name__ == node.name, \
                    f"{path.name}: pass class {node.name} ({name!r}) is not in the pass table"

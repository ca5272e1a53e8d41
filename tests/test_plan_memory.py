"""The ``plan-memory`` pass: IR text in, the plan's text out; the verifier refusing a plan that does
not fit; lowering reading the plan only; and, on every model family the suite builds and every ISA
target, no two buffers live at one node overlap and the arena is no larger than the one lowering
planned before the pass existed (``golden/plan_memory_peaks.json``)."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from test_passes import assert_ir, run

from infeng_common.errors import InfengError, IRError
from infeng_compiler.codegen.lower import lower
from infeng_compiler.codegen.target import TARGETS, get_target
from infeng_compiler.compile import CompileOptions, run_pipeline
from infeng_compiler.ir import Graph, parse, print_graph
from infeng_compiler.ir.memory import MemoryPlan
from infeng_compiler.ir.serialize import from_json, to_json
from infeng_compiler.passes.manager import PassManager, parse_pipeline

PEAKS = json.loads((Path(__file__).parent / "golden" / "plan_memory_peaks.json").read_text())["peaks"]

ROPE = """
graph @g(%tokens: i32[T], %positions: i32[T]) {
  meta {"vocab_size": 32, "hidden_size": 16}
  weight @emb : f32[32,16]
  weight @q.weight : f32[16,16]
  weight @q.bias : f32[16]
  %h = embedding(%tokens, @emb) : f32[T,16]
  %q = linear(%h, @q.weight, @q.bias) : f32[T,16]
  %q_rot = rope(%q, %positions) : f32[T,16] {n_heads=2, head_dim=8, theta=10000.0}
  %s = add(%h, %q_rot) : f32[T,16]
  %logits = logits(%s, @emb) : f32[R,32]
  return %logits
}
"""


def test_plan_text_values_in_place_scratch_and_weights() -> None:
    """rope writes over q (nothing reads q afterwards), the logits' gathered rows reuse the slice
    freed by the add, a bias sits before its matrix, a tied table is placed once."""
    g = run(parse(ROPE), "plan-memory")
    assert_ir(print_graph(g), """
    CHECK: return %logits
    CHECK: # memory: arena peak 192 bytes per token row (48 floats), 3 buffers, 1 scratch; weights.bin 3,136 bytes
    CHECK: memory {arena_floats=48, weights_bytes=3136}
    CHECK: arena %h {offset=0, size=16, live=[0, 3]}
    CHECK: arena %q, %q_rot {offset=16, size=16, live=[1, 3]}
    CHECK: arena %s {offset=32, size=16, live=[3, 4]}
    CHECK: scratch rows of %logits {offset=16, size=16, live=[4, 4]}
    CHECK: place @emb {offset=0, size=2048, live=[0, 4]}
    CHECK: place @q.bias {offset=2048, size=64, live=[1, 1]}
    CHECK: place @q.weight {offset=2112, size=1024, live=[1, 1]}
    CHECK: }
    """)
    again = parse(print_graph(g))
    assert again == g and again.memory.signature() == g.memory.signature()
    assert from_json(to_json(g)) == g
    rerun = PassManager(parse_pipeline("plan-memory"))
    rerun.run(g)
    assert rerun.records[0].changed is False and rerun.records[0].tolerance == 0


def test_quantized_rows_keep_their_f32_source_live(stories_dir) -> None:
    """int4 weights read int8 rows (48 floats for 64 values); the norm's f32 rows stay live until
    the linear reading the quantized rows (the logits and f32 fallbacks read them)."""
    g = run_pipeline(stories_dir, CompileOptions(passes="cast-weights(f32),quantize(int4,clip=0),act-precision(int8)")).graph
    assert_ir(print_graph(g), """
    CHECK: %l0.attn_norm.q8 = quantize_act(%l0.attn_norm) : f32[T,64] {bits=8, block=32}
    CHECK: memory {arena_floats=
    CHECK: arena %l0.attn_norm {offset=64, size=64, live=[1, 5]}
    CHECK: arena %l0.attn_norm.q8 {offset=128, size=48, live=[2, 5]}
    CHECK: scratch qrows of %logits
    """)


def test_the_verifier_refuses_overlapping_live_buffers() -> None:
    text = print_graph(run(parse(ROPE), "plan-memory"))
    clash = text.replace("arena %s {offset=32,", "arena %s {offset=8,")
    with pytest.raises(IRError, match=r"arena %h and arena %s are live at one node and overlap"):
        parse(clash)
    short = text.replace("arena %h {offset=0, size=16, live=[0, 3]}", "arena %h {offset=0, size=16, live=[0, 2]}")
    with pytest.raises(IRError, match=r"%h is live over nodes \[0, 3\], outside its buffer's \[0, 2\]"):
        parse(short)
    with pytest.raises(IRError, match="@emb and @q.bias overlap in weights.bin"):
        parse(text.replace("place @q.bias {offset=2048,", "place @q.bias {offset=2000,"))


def test_lowering_reads_the_plan_and_refuses_a_stale_one() -> None:
    g = parse(ROPE)
    with pytest.raises(InfengError, match="no memory plan; run the plan-memory pass"):
        lower(g, get_target("scalar"), max_tokens=8, block_size=16)
    run(g, "plan-memory,cast-weights(f16)")          # @emb now takes half the bytes it was placed with
    with pytest.raises(InfengError, match=r"@emb takes 1024 bytes, placed as 2048\); plan-memory must run after"):
        lower(g, get_target("scalar"), max_tokens=8, block_size=16)


def test_an_explicit_pipeline_ends_with_the_memory_plan() -> None:
    assert CompileOptions(passes="cast-weights(f16)").pipeline()[-1] == ("plan-memory", [])
    assert CompileOptions(passes="cast-weights(f16),plan-memory").pipeline()[-1] == ("plan-memory", [])
    with pytest.raises(InfengError, match=r"plan-memory plans the final graph; put it last \(after cast-weights\)"):
        CompileOptions(passes="plan-memory,cast-weights(f16)").pipeline()


# ---------------------------------------------------------------------------------------------
# every family and target: no overlap, no larger than before
def quantized(fmt: str, act: str = "int8", lora: str = "") -> dict:
    """Options whose passes quantize the weights to ``fmt`` (no clipping search) with ``act``
    activations, after LoRA slots ``lora`` ("2,4") when given."""
    slots = f"lora-slots({lora})," if lora else ""
    return {"passes": f"{slots}cast-weights(f32),quantize({fmt},clip=0),act-precision({act}),fuse-linears"}


#: case -> (model, CompileOptions fields); the model families the suite builds, with the formats
#: that give kernels scratch rows (integer logits, LoRA deltas of int rows, routers, experts)
CASES: dict[str, tuple[str, dict]] = {
    "stories-f32": ("stories", {}),
    "stories-int4-fht": ("stories", {"passes": "fht-kv,kv-format(int8),cast-weights(f32),quantize(int4,clip=0),"
                                               "act-precision(int8),fuse-linears"}),
    "stories-int8-auto": ("stories", quantized("int8", act="auto,16")),
    "stories-lora-int4": ("stories", quantized("int4", act="auto,16", lora="2,4")),
    "stories-f16": ("stories", {"dtype": "f16"}),
    "tiny-llama-int4": ("tiny-llama", quantized("int4")),
    "tiny-mistral": ("tiny-mistral", {}),
    "tiny-qwen2": ("tiny-qwen2", {}),
    "tiny-gpt2": ("tiny-gpt2", {}),
    "tiny-gpt2-int8": ("tiny-gpt2", quantized("int8")),
    "gpt-oss-mxfp4-q8": ("gpt-oss", {"passes": "cast-weights(f32),experts-act(q8),fuse-linears"}),
    "gpt-oss-f32": ("gpt-oss", {}),
    "gpt-oss-int8-lora": ("gpt-oss", quantized("int8", lora="2,4")),
    "qwen2-moe-int4": ("qwen2_moe", quantized("int4")),
    "qwen2-moe-int8": ("qwen2_moe", quantized("int8")),
    "qwen2-moe-f32": ("qwen2_moe", {}),
}
#: built with transformers (torch): seconds, so left to the slow run
SLOW_MODELS = {"qwen2_moe"}


@pytest.fixture(scope="module")
def case_model(stories_dir, synthetic_checkpoint, tmp_path_factory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("plan-memory")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name == "stories":
            return stories_dir
        if name not in built:
            if name == "gpt-oss":
                from infeng_models.gpt_oss_shape import TINY, write_checkpoint

                built[name] = write_checkpoint(root / name, TINY, seed=3)
            elif name == "qwen2_moe":
                from conftest import build_hf_checkpoint
                from test_moe import MOE_VARIANTS

                built[name] = build_hf_checkpoint(MOE_VARIANTS[name], root / name)
            else:
                built[name] = synthetic_checkpoint(name)
        return built[name]

    return get


def live_at_each_node(g: Graph, plan: MemoryPlan) -> None:
    """Independently of ``check_plan``: at every node, each value it reads or writes (and the f32
    rows under quantized rows it reads) is in a buffer live there, and the buffers live there are
    disjoint in the arena."""
    buffer_of = {v: b for b in plan.buffers if not b.scratch for v in b.values}
    producers = g.producers()
    for i, n in enumerate(g.nodes):
        touched = [v.name for v in n.inputs if v.name in producers]
        touched += [producers[v].inputs[0].name for v in touched if producers[v].op == "quantize_act"]
        touched += [v.name for v in n.outputs if n.op != "logits"]
        for name in touched:
            b = buffer_of[name]
            assert b.first <= i <= b.last, (i, name, b)
        spans = sorted((b.offset, b.offset + b.size, b.label) for b in plan.buffers if b.first <= i <= b.last)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            assert end <= start, f"node {i}: {a} and {b} overlap"


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.slow) if model in SLOW_MODELS else name
                                  for name, (model, _) in CASES.items()])
def test_no_live_buffers_overlap_and_the_arena_is_no_larger(case: str, case_model) -> None:
    model, fields = CASES[case]
    graph = run_pipeline(case_model(model), CompileOptions(**fields)).graph
    plan = graph.memory
    live_at_each_node(graph, plan)
    assert plan.arena_floats <= PEAKS[case]["arena_floats_per_row"]
    assert plan.weights_bytes <= PEAKS[case]["weights_bytes"]
    placed = [(w.name, w.offset, w.size) for w in plan.weights]
    for target in [*TARGETS, "native"]:
        lowered = lower(graph, get_target(target), max_tokens=16, block_size=16)
        assert lowered.arena_floats_per_row == plan.arena_floats and lowered.weights_bytes == plan.weights_bytes
        assert [(s.name, s.offset, s.nbytes) for s in lowered.weights] == placed
        for call in lowered.calls:        # every arena pointer lowering passes is a planned slice
            for offset in re.findall(r"arena \+ (\d+) \* IFE_MAX_TOKENS", " ".join(call.args + [call.code])):
                assert int(offset) in {b.offset for b in plan.buffers}, (target, call.comment)


def test_infeng_ir_after_plan_memory_prints_the_plan(stories_dir) -> None:
    from typer.testing import CliRunner

    from infeng_cli.main import app

    result = CliRunner().invoke(app, ["ir", str(stories_dir), "--quant", "int8", "--after", "plan-memory"])
    assert result.exit_code == 0, result.output
    assert_ir(result.stdout, """
    CHECK: return %logits
    CHECK: # memory: arena peak
    CHECK: memory {arena_floats=
    CHECK: arena %embed {offset=0, size=64, live=[0,
    CHECK: scratch rows of %logits
    CHECK: place @model.embed_tokens.weight {offset=0, size=
    """)
    memory = CliRunner().invoke(app, ["ir", str(stories_dir), "--quant", "int8", "--after", "memory"])
    assert memory.exit_code == 0 and memory.stdout == result.stdout

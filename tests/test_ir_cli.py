"""``infeng ir``: every stage of the compile pipeline is visible, as XLA's dumps are: the IR after
the import and after each compile pass the options choose, then the lowered kernel calls."""
from __future__ import annotations

import re

from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model


def run(*args: str):
    return CliRunner().invoke(app, ["ir", *args])


def test_after_all_prints_every_pass_then_the_lowered_calls(stories_dir):
    result = run(str(stories_dir), "--quant", "int4", "--kv", "fht-int8", "--target", "avx512", "--after", "all")
    assert result.exit_code == 0, result.output
    stages = re.findall(r"^# after (\S+)$", result.stdout, re.M)
    assert stages == ["import", "fht-kv", "kv-format", "cast-weights", "quantize", "fuse-linears", "plan-memory",
                      "lower"]
    quantized = result.stdout.split("# after quantize\n")[1].split("# after fuse-linears")[0]
    assert ': q4g32[' in quantized
    lowered = result.stdout.split("# after lower\n")[1]
    assert lowered.startswith("# lowered for avx512:")
    assert re.search(r"ife_linear_q4_q4g32_\w+_avx512\(pool, .*\(const uint8_t \*\)\(weights \+ \d+\)", lowered)
    assert "(arena + " in lowered and "attention" in lowered


def test_after_one_pass_or_lower(stories_dir):
    quantize = run(str(stories_dir), "--quant", "int8", "--after", "quantize")
    assert quantize.exit_code == 0, quantize.output
    assert "# after" not in quantize.stdout and ': q8r[' in quantize.stdout
    lower = run(str(stories_dir), "--after", "lower", "--target", "scalar")
    assert lower.exit_code == 0 and lower.stdout.startswith("# lowered for scalar:")


def test_unknown_pass_names_the_pipeline(stories_dir):
    result = run(str(stories_dir), "--quant", "int4", "--after", "nope")
    assert result.exit_code == 2
    assert "--after nope: no such pass ran" in result.output and "quantize" in result.output
    assert "Traceback" not in result.output


def test_an_artifact_prints_its_final_ir(stories_dir, tmp_path):
    out = tmp_path / "stories.infeng"
    compile_model(stories_dir, out, CompileOptions(target="scalar", quant="int8"))
    result = run(str(out))
    assert result.exit_code == 0 and result.stdout == (out / "ir.txt").read_text()


def test_after_all_prints_meta_once_and_4bit_weights_as_such(stories_dir):
    result = run(str(stories_dir), "--quant", "int4", "--after", "all")
    assert result.exit_code == 0, result.output
    assert len(re.findall(r"^  meta \{", result.stdout, re.M)) == 1
    assert result.stdout.count("  # meta as after import") == result.stdout.count("# after ") - 2   # - import, lower
    quantized = result.stdout.split("# after quantize\n")[1].split("# after fuse-linears")[0]
    assert re.search(r'weight @model\.layers\.0\.self_attn\.q_proj\.weight : q4g32\[64,64\] \{source="f32"', quantized)
    assert "format=" not in quantized


def test_after_a_phase_is_after_its_last_pass(stories_dir):
    """``--after storage`` prints what ``--after quantize`` (its last pass) prints; an empty phase
    (no LoRA: ``model``) prints the graph as it entered it."""
    storage = run(str(stories_dir), "--quant", "int8", "--after", "storage")
    quantize = run(str(stories_dir), "--quant", "int8", "--after", "quantize")
    assert storage.exit_code == 0 and storage.stdout == quantize.stdout, storage.output
    model = run(str(stories_dir), "--quant", "int8", "--after", "model")
    imported = run(str(stories_dir), "--after", "import")
    assert model.exit_code == 0 and model.stdout == imported.stdout

"""``infeng compile --replay ARTIFACT``: the manifest records the model, every input file's sha256,
the options and every pass (arguments, declared tolerance, changed, time), so the artifact
rebuilds byte for byte (weights.bin and libmodel.so); a changed input is refused. Two compiles to
one ``-o`` swap their results in atomically."""
from __future__ import annotations

import json
import shutil
import threading

import pytest
from _serving import write_adapter
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model, replay_options
from infeng_compiler.options import DEFAULT_CALIB_TOKENS

ASSETS_TEXT = "text/wikitext-2-raw-v1-test.txt"


def compile_cli(*args: str):
    result = CliRunner().invoke(app, ["compile", *args])
    assert result.exit_code == 0, result.output
    return result


def files_of(artifact) -> dict:
    return json.loads((artifact / "manifest.json").read_text())["files"]


@pytest.fixture(scope="module")
def calib(assets, tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_bytes((assets / ASSETS_TEXT).read_bytes()[200_000:230_000])
    return path


@pytest.mark.parametrize("case", ["f32", "int4-calib", "fht-int8-calib", "merged-adapter"])
def test_replay_is_byte_identical(stories_dir, calib, tmp_path, case):
    args = {"f32": [], "int4-calib": ["--quant", "int4", "--calib", str(calib)],
            "fht-int8-calib": ["--kv", "fht-int8", "--calib", str(calib)],
            "merged-adapter": ["--lora", f"a={write_adapter(tmp_path / 'a', seed=5)}", "--merge", "a"]}[case]
    first, again = tmp_path / "first.infeng", tmp_path / "again.infeng"
    compile_cli(str(stories_dir), "-o", str(first), "--target", "scalar", *args)
    record = json.loads((first / "manifest.json").read_text())["compile"]
    assert record["options"]["target"] == "scalar" and str(stories_dir.resolve() / "model.safetensors") in record["inputs"]
    assert all({"name", "args", "phase", "tolerance", "changed", "seconds"} <= set(p) for p in record["passes"])
    assert [p["name"] for p in record["phases"]] == ["model", "storage", "fusion", "memory"]
    pipeline = json.loads((first / "manifest.json").read_text())["pipeline"]
    assert ",".join(e for p in record["phases"] for e in p["passes"]) == pipeline
    if case == "int4-calib":            # the token budget is recorded, so the replay calibrates on the same chunks
        assert record["options"]["calib_tokens"] == DEFAULT_CALIB_TOKENS
        assert f"calib_tokens={DEFAULT_CALIB_TOKENS}" in pipeline
    compile_cli("--replay", str(first), "-o", str(again))
    assert files_of(again) == files_of(first)


def test_a_record_from_before_the_calibration_budget_replays_every_chunk(stories_dir, calib, tmp_path):
    """A compile record without ``calib_tokens`` was written before the budget: it calibrated on
    every chunk, so its replay does (``calib_tokens=0``), not on today's default budget."""
    built = tmp_path / "built.infeng"
    compile_cli(str(stories_dir), "-o", str(built), "--target", "scalar", "--quant", "int8")
    manifest = json.loads((built / "manifest.json").read_text())
    del manifest["compile"]["options"]["calib_tokens"]
    (built / "manifest.json").write_text(json.dumps(manifest))
    assert replay_options(built)[1].calib_tokens == 0


def test_a_changed_input_is_refused(stories_dir, calib, tmp_path):
    text = tmp_path / "calib.txt"
    shutil.copy(calib, text)
    first = tmp_path / "first.infeng"
    compile_cli(str(stories_dir), "-o", str(first), "--target", "scalar", "--quant", "int8", "--calib", str(text))
    text.write_text(text.read_text() + "more")
    result = CliRunner().invoke(app, ["compile", "--replay", str(first), "-o", str(tmp_path / "b.infeng")])
    assert result.exit_code == 2 and "calib.txt: changed since" in result.output


def test_concurrent_compiles_to_one_output(stories_dir, tmp_path):
    out, errors = tmp_path / "same.infeng", []

    def build(quant):
        try:
            compile_model(stories_dir, out, CompileOptions(target="scalar", quant=quant))
        except Exception as e:          # noqa: BLE001  (the test reports any)
            errors.append(e)

    threads = [threading.Thread(target=build, args=(q,)) for q in ("int8", "int4", None)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / "weights.bin").stat().st_size == manifest["weights_bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".same.infeng.old")]


def test_a_reused_copy_reads_its_own_manifest(stories_dir, tmp_path, monkeypatch):
    """A reuse copies the built artifact and swaps it in; another compile to the same ``-o`` may swap
    in its own at once (CI saw "same.infeng: no such file" from the read after the swap). The
    summary comes from the copy, whatever ``-o`` holds by then."""
    from infeng_compiler import compile as compile_module

    options = CompileOptions(target="scalar", quant="int8")
    compile_model(stories_dir, tmp_path / "first.infeng", options)
    out = tmp_path / "same.infeng"
    swap = compile_module._swap_into_place

    def swap_then_lose_it(staging, out_dir):     # the window in which another compile replaces it
        swap(staging, out_dir)
        shutil.rmtree(out_dir)

    monkeypatch.setattr(compile_module, "_swap_into_place", swap_then_lose_it)
    summary = compile_model(stories_dir, out, options)
    assert summary.cache_hit and summary.out_dir == out and summary.pipeline


def test_output_onto_a_file_is_one_line(stories_dir, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    result = CliRunner().invoke(app, ["compile", str(stories_dir), "-o", str(target)])
    assert result.exit_code == 2 and "is not an artifact directory" in result.output and target.read_text() == "x"

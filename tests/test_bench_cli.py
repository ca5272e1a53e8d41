"""`infeng compile --profile`, `infeng bench` and its Chrome trace (speed is reported, never asserted)."""
from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_runtime.engine import Engine


def test_profiled_build_times_every_node_and_computes_the_same(tmp_path, stories_dir):
    plain, profiled = tmp_path / "plain.infeng", tmp_path / "profiled.infeng"
    compile_model(stories_dir, plain, CompileOptions(target="scalar"))
    compile_model(stories_dir, profiled, CompileOptions(target="scalar", profile=True))
    assert "IFE_PROF_BEGIN" not in (plain / "src" / "model.c").read_text()
    a, b = Engine(plain), Engine(profiled)
    assert not a.profiled and b.profiled
    ids = np.array([1, 400, 20, 33])
    np.testing.assert_array_equal(a.step(ids, np.arange(4), np.zeros(4)), b.step(ids, np.arange(4), np.zeros(4)))
    entries = b.profile()
    manifest = json.loads((profiled / "manifest.json").read_text())
    assert len(entries) == len(manifest["profile"]) == (profiled / "ir.txt").read_text().count(" = ")
    assert all(e["calls"] == 1 and e["ns"] >= 0 for e in entries)

    out = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["bench", str(profiled), "--prompt-len", "16", "--gen-len", "4", "--profile",
                                      "--trace", str(out), "--no-bandwidth", "--json", "--threads", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    kinds = {r["bench"] for r in rows}
    assert {"prefill", "decode", "profile", "profile_total"} <= kinds
    decode = next(r for r in rows if r["bench"] == "decode")
    assert decode["tok_s"] > 0 and decode["p95_ms"] >= decode["p50_ms"] > 0
    events = json.loads(out.read_text())["traceEvents"]
    assert events and all(e["ph"] == "X" and e["dur"] >= 0 for e in events)

    result = CliRunner().invoke(app, ["bench", str(plain), "--profile", "--no-bandwidth"])
    assert result.exit_code == 2 and "--profile" in result.output

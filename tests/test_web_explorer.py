"""The IR explorer in headless Chromium over stories260K: ``infeng ir --html`` (one file) and
``infeng explore`` (served) show every stage of the pipeline, the diff between two stages as
``infeng ir --after all`` prints them, a node's kernel with the C source the artifact was built
from, and the heat overlay of an ``infeng bench --profile --node-profile`` run; ``--format
model-explorer`` writes a graph Model Explorer reads."""
from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
import pytest
from _browser import browser, page, screenshot  # noqa: F401  (fixtures)
from _serving import STORIES, free_port, infeng_command
from typer.testing import CliRunner, Result

from infeng_cli.main import app
from infeng_compiler.explore import explorer_html
from infeng_runtime.web import CONTENT_SECURITY_POLICY

#: Markup that must show as text wherever an IR string appears.
HOSTILE = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def infeng(*args: str, exit_code: int = 0) -> Result:
    """``infeng ARGS`` in this process; checks its exit code."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == exit_code, result.output
    return result


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """(artifact built with --profile, its node profile from infeng bench, the explorer HTML file)."""
    root = tmp_path_factory.mktemp("explorer")
    artifact, profile, html = root / "stories.infeng", root / "nodes.json", root / "explorer.html"
    infeng("compile", str(STORIES), "--target", "scalar", "--profile", "-o", str(artifact))
    infeng("bench", str(artifact), "--profile", "--node-profile", str(profile), "--prompt-len", "8", "--gen-len", "8",
           "--threads", "1")
    infeng("ir", str(artifact), "--html", str(html), "--node-profile", str(profile))
    return artifact, profile, html


def text_stages(artifact) -> dict[str, dict[str, str]]:
    """Each stage's nodes (first result -> IR line) as ``infeng ir --after all`` prints them."""
    source = json.loads((artifact / "manifest.json").read_text())["compile"]["model"]
    text = infeng("ir", source, "--target", "scalar", "--after", "all").stdout
    stages: dict[str, dict[str, str]] = {}
    for section in text.split("# after ")[1:]:
        name, _, body = section.partition("\n")
        if name == "lower":
            continue
        stages[name] = {re.match(r"%([^,\s]+)", line.strip()).group(1): line.strip()
                        for line in body.splitlines() if line.startswith("  %")}
    return stages


def open_explorer(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("body[data-ready=true]")


def test_every_stage_and_a_diff(profiled, page):
    artifact, _, html = profiled
    expected = text_stages(artifact)
    open_explorer(page, html.as_uri())
    names = page.locator("#timeline .stage").evaluate_all("buttons => buttons.map(b => b.dataset.stage)")
    assert names == [*expected, "lower"]
    assert list(expected) == ["import", "cast-weights", "fuse-linears", "plan-memory"]
    before, after = expected["cast-weights"], expected["fuse-linears"]
    added = [i for i in after if i not in before]
    removed = [i for i in before if i not in after]
    changed = [i for i in after if i in before and before[i] != after[i]]
    assert added and removed and changed
    page.click('#timeline .stage[data-stage="fuse-linears"]')
    assert page.locator("#diff-summary").inner_text() == (f"{len(added)} added, {len(removed)} removed, "
                                                          f"{len(changed)} changed")
    shown_added = page.locator("#items g.item.added").evaluate_all("gs => gs.map(g => g.dataset.id)")
    shown_changed = page.locator("#items g.item.changed").evaluate_all("gs => gs.map(g => g.dataset.id)")
    assert sorted(shown_added) == sorted(added) and sorted(shown_changed) == sorted(changed)
    assert page.locator(".diff-list li.removed").count() == len(removed)
    page.click('#timeline .stage[data-stage="import"]')
    assert page.locator("#items g.item").count() == len(expected["import"])
    page.click("#collapse-all")
    assert page.locator("#items g.item.group").count() == 5          # stories260K's five layers
    page.click('#items g.item.group[data-layer="2"]')
    assert page.locator("#items g.item.group").count() == 4
    assert page.errors == []


def test_node_kernel_source_is_the_built_source(profiled, page):
    artifact, _, html = profiled
    open_explorer(page, html.as_uri())
    page.click('#items g.item[data-id="l0.q_k_v"]')
    assert page.locator("#node-ir").inner_text().startswith("%l0.q_k_v = linear(")
    call = page.locator("#node pre.call").first.inner_text()
    symbol = call.split("(")[0]
    assert symbol.startswith("ife_linear_")
    assert page.locator("#node pre.source").first.inner_text() == (artifact / "src" / f"{symbol}.c").read_text()
    assert "weights" in page.locator("#node").inner_text().lower()
    assert page.locator("#node table").nth(1).inner_text().count("f32") >= 1       # storage format


def test_profile_heat_overlay(profiled, page, screenshot):
    artifact, profile_path, html = profiled
    profile = {row["name"]: row for row in json.loads(profile_path.read_text())["nodes"]}
    final = [re.match(r"\s*%([^,\s]+)", line).group(1) for line in (artifact / "ir.txt").read_text().splitlines()
             if line.startswith("  %")]
    assert list(profile) == final                                   # one row per node, in graph order
    assert 0 < sum(row["pct_of_step"] for row in profile.values()) <= 100.5
    open_explorer(page, html.as_uri())
    page.check("#heat")
    hottest = max(profile.values(), key=lambda row: row["pct_of_step"])
    fills = page.locator("#items g.item rect").evaluate_all("rs => rs.map(r => r.style.fill)")
    assert fills and all(fills)
    page.fill("#find", hottest["name"])
    page.press("#find", "Enter")
    page.click(f'#items g.item[data-id="{hottest["name"]}"]')          # centred by the find box
    row = page.locator("#node table", has_text="% of step").locator("tr").nth(1).locator("td").all_inner_texts()
    assert row[1] == str(hottest["pct_of_step"])
    assert "profile:" in page.locator("#heat-legend").inner_text()
    screenshot(page, "web-explorer")


def test_served_explorer(profiled, page, tmp_path):
    artifact, profile, _ = profiled
    port = free_port()
    log = open(tmp_path / "explore.log", "wb")
    proc = subprocess.Popen([*infeng_command(), "explore", str(artifact), "--port", str(port), "--node-profile",
                             str(profile)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "explore.log").read_text()
            try:
                if httpx.get(url + "/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "explore.log").read_text()
            time.sleep(0.1)
        response = httpx.get(url + "/")
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert httpx.get(url + "/nothing.js").status_code == 404
        open_explorer(page, url + "/")
        assert page.locator("#timeline .stage").count() == 5      # import, 3 passes, lower
        assert page.errors == [] and page.console_errors == []
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_model_explorer_format(profiled, tmp_path):
    artifact, profile, _ = profiled
    out = tmp_path / "graph.json"
    infeng("ir", str(artifact), "--format", "model-explorer", "-o", str(out), "--node-profile", str(profile))
    collection = json.loads(out.read_text())
    nodes = collection["graphs"][0]["nodes"]
    ids = {n["id"] for n in nodes}
    assert len(ids) == len(nodes)
    final = [line for line in (artifact / "ir.txt").read_text().splitlines() if line.startswith("  %")]
    assert len([n for n in nodes if not n["id"].startswith("input:")]) == len(final)
    for n in nodes:
        assert {"id", "label", "namespace", "attrs", "incomingEdges", "outputsMetadata"} <= set(n)
        assert all(e["sourceNodeId"] in ids for e in n["incomingEdges"])
    qkv = next(n for n in nodes if n["id"] == "l0.q_k_v")
    keys = {a["key"] for a in qkv["attrs"]}
    assert {"ir", "kernel", "pct_of_step"} <= keys and qkv["namespace"] == "layer_0"
    node_data = json.loads((tmp_path / "graph.nodedata.json").read_text())
    results = node_data[collection["graphs"][0]["id"]]["results"]
    timing = {row["name"]: row["pct_of_step"] for row in json.loads(profile.read_text())["nodes"]}
    assert {k: v["value"] for k, v in results.items()} == timing and set(results) <= ids


def test_ir_strings_are_text(profiled, page, tmp_path):
    """Names, IR lines, attributes and C source carrying markup are shown as text; none of it runs,
    not even a ``</script>`` inside the data embedded in the single file."""
    artifact, _, html = profiled
    data = json.loads(html.read_text().split('<script type="application/json" id="ir-data">')[1]
                      .split("</script>")[0].replace("<\\/", "</"))
    data["model"] = HOSTILE
    node = data["stages"][-1]["nodes"][0]
    node["text"] += HOSTILE
    node["attrs"]["note"] = HOSTILE
    node["kernels"][0]["symbol"] = HOSTILE
    data["sources"][HOSTILE] = HOSTILE
    data["stages"][1]["name"] = HOSTILE
    hostile = tmp_path / "hostile.html"
    hostile.write_text(explorer_html(data))
    open_explorer(page, hostile.as_uri())
    page.click(f'#items g.item[data-id="{node["id"]}"]')
    assert HOSTILE in page.locator("#node-ir").inner_text()
    assert page.locator("#node pre.source").first.inner_text() == HOSTILE
    assert page.locator("#model-name").inner_text().startswith(HOSTILE)
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0
    assert page.locator("script").count() == 2                      # the data and the page's own script
    assert page.errors == []


def test_bad_inputs_are_one_line(profiled, tmp_path):
    artifact, _, _ = profiled
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args, says in [(["ir", str(artifact), "--html", str(tmp_path / "x.html"), "--node-profile", str(bad)],
                        "not a node profile"),
                       (["ir", str(artifact), "--html", str(tmp_path / "x.html"), "--format", "json"], "--html"),
                       (["ir", str(STORIES), "--format", "model-explorer", "--after", "all"], "--after"),
                       (["explore", str(tmp_path / "missing"), "--port", str(free_port())], "missing")]:
        output = infeng(*args, exit_code=2).output
        assert says in output and len(output.strip().splitlines()) == 1, output

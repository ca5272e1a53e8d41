"""What ``infeng compile`` refuses before it builds anything, each as one line and exit code 2:
NaN/Inf weights, special token ids that are not ids of the vocabulary, ``--passes`` with options
it would silently drop. And the build cache does not depend on where the model sits."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model


def compile_cli(*args: str):
    return CliRunner().invoke(app, ["compile", *args])


@pytest.fixture
def model(stories_dir, tmp_path):
    copy = tmp_path / "stories"
    shutil.copytree(stories_dir, copy)
    return copy


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused(model, tmp_path, value):
    weights = load_file(str(model / "model.safetensors"))
    weights["model.layers.2.mlp.up_proj.weight"][3, 4] = value
    save_file(weights, str(model / "model.safetensors"))
    result = compile_cli(str(model), "-o", str(tmp_path / "out.infeng"))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "tensor model.layers.2.mlp.up_proj.weight has non-finite values" in result.output


@pytest.mark.parametrize("key, value", [("eos_token_id", "2"), ("eos_token_id", 100000), ("bos_token_id", -1),
                                        ("eos_token_id", [2, True])])
def test_special_token_ids_are_checked(model, tmp_path, key, value):
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    result = compile_cli(str(model), "-o", str(tmp_path / "out.infeng"))
    assert result.exit_code == 2 and f"config.json: {key} must be a token id in [0, 512)" in result.output


def test_passes_with_other_pipeline_options_is_an_error(model, tmp_path):
    result = compile_cli(str(model), "-o", str(tmp_path / "out.infeng"), "--passes", "cast-weights(f32)",
                         "--quant", "int8")
    assert result.exit_code == 2 and "--passes is the whole pipeline; --quant would be ignored" in result.output


def test_build_cache_hits_wherever_the_model_sits(stories_dir, tmp_path):
    first = compile_model(stories_dir, tmp_path / "a.infeng", CompileOptions(target="scalar", quant="int8"))
    elsewhere = tmp_path / "a-differently-named-copy"
    shutil.copytree(stories_dir, elsewhere)
    second = compile_model(elsewhere, tmp_path / "b.infeng", CompileOptions(target="scalar", quant="int8"))
    assert second.cache_hit
    assert (tmp_path / "a.infeng" / "libmodel.so").read_bytes() == (tmp_path / "b.infeng" / "libmodel.so").read_bytes()
    assert first.out_dir != second.out_dir


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_bf16_weights_are_refused_by_their_bits(value):
    """bf16 weights are checked on their exponent bits (no float32 copy): NaN and ±Inf found,
    the largest finite bf16 passes."""
    from infeng_compiler.compile import _all_finite_stored
    from infeng_compiler.ir import TensorType, Weight

    bits = (np.array([1.0, -2.5, 3.3895314e38, value], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert _all_finite_stored(Weight("w", TensorType("bf16", (3,)), array=bits[:3]))
    assert not _all_finite_stored(Weight("w", TensorType("bf16", (4,)), array=bits))

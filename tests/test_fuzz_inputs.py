"""Fuzzing the files a user hands infeng: ``config.json``, ``adapter_config.json`` and an
artifact's ``manifest.json`` with values of every JSON type in every key. Each generated input
gives a loaded model, or one ``InfengError`` whose message is one line naming the file; never
another exception (a traceback), a crash or a hang."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager

import pytest
from _serving import write_adapter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infeng_common.errors import InfengError
from infeng_common.peft import read_adapter
from infeng_compiler.frontends.hf import import_hf

values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10, 10 ** 12), st.floats(allow_nan=True),
                                st.text(max_size=8)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3)),
                      max_leaves=6)
#: 300 inputs a file in the suite, the same every run (derandomized); INFENG_FUZZ_EXAMPLES=N runs N
#: random ones (the longer run docs/architecture.md reports).
FUZZ = settings(max_examples=int(os.environ.get("INFENG_FUZZ_EXAMPLES", 300)), deadline=None,
                derandomize="INFENG_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def clean_error(e: InfengError, path) -> None:
    assert str(path) in str(e) and "\n" not in str(e), str(e)


@contextmanager
def edited(path, edits: dict):
    """``path`` (a JSON object) with ``edits`` merged in, restored afterwards."""
    original = path.read_text()
    try:
        path.write_text(json.dumps({**json.loads(original), **edits}))
        yield
    finally:
        path.write_text(original)


@pytest.fixture(scope="module")
def model(stories_dir, tmp_path_factory):
    copy = tmp_path_factory.mktemp("fuzz-model") / "stories"
    shutil.copytree(stories_dir, copy)
    return copy


CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type",
               "sliding_window", "attention_bias", "hidden_act", "partial_rotary_factor"]


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(CONFIG_KEYS), values, min_size=1, max_size=3))
def test_config_json(model, edits):
    try:
        with edited(model / "config.json", edits):
            import_hf(model)
    except InfengError as e:
        assert "\n" not in str(e), str(e)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("fuzz-adapter") / "a", seed=3)


ADAPTER_KEYS = ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "layers_to_transform",
                "use_rslora", "use_dora", "peft_type", "base_model_name_or_path", "fan_in_fan_out"]
LINEARS = {f"model.layers.{i}.self_attn.{m}.weight": shape for i in range(5)
           for m, shape in (("q_proj", (64, 64)), ("v_proj", (32, 64)))}


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(ADAPTER_KEYS), values, min_size=1, max_size=3))
def test_adapter_config_json(adapter, edits):
    try:
        with edited(adapter / "adapter_config.json", edits):
            read_adapter(adapter, LINEARS, "a", base_name="stories260K")
    except InfengError as e:
        clean_error(e, adapter)


@pytest.fixture(scope="module")
def artifact(stories_dir, tmp_path_factory):
    from infeng_compiler.compile import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("fuzz-artifact") / "stories.infeng"
    compile_model(stories_dir, out, CompileOptions(target="scalar"))
    return out


MANIFEST_KEYS = ["format_version", "name", "target", "meta", "constants", "weights_bytes", "files", "adapters"]


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(MANIFEST_KEYS), values, min_size=1, max_size=2))
def test_manifest_json(artifact, edits):
    from infeng_runtime.engine import Engine

    try:
        with edited(artifact / "manifest.json", edits):
            Engine(artifact, threads=1, max_seqs=1).close()
    except InfengError as e:
        clean_error(e, artifact)

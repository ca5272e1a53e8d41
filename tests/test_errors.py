"""Bad input fails loudly: an InfengError naming the file (and tensor), and exit code 2 from the CLI.

Every case starts from a fresh copy of a good synthetic checkpoint (tiny-llama, or tiny-gpt2 for the
``gpt2_`` cases) and breaks one thing.
"""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from infeng_common.errors import InfengError, ModelFormatError, UnsupportedError
from infeng_compiler.frontends.hf import import_hf


# ---------------------------------------------------------------------------------------------
# helpers that break a checkpoint
def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))


def rewrite_tensors(model: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(model / "model.safetensors")
    edit(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@dataclass(frozen=True)
class Expect:
    """What a case should raise: the class, and substrings the message must contain."""

    error: type[InfengError]
    mentions: tuple[str, ...]


def case_missing_dir(m: Path) -> tuple[Path, Expect]:
    return m.parent / "no-such-model", Expect(ModelFormatError, ("no-such-model", "no such file or directory"))


def case_missing_config(m: Path) -> tuple[Path, Expect]:
    (m / "config.json").unlink()
    return m, Expect(ModelFormatError, (str(m / "config.json"),))


def case_missing_safetensors(m: Path) -> tuple[Path, Expect]:
    (m / "model.safetensors").unlink()
    return m, Expect(ModelFormatError, (str(m), "model.safetensors"))


def case_pickle_checkpoint(m: Path) -> tuple[Path, Expect]:
    (m / "model.safetensors").rename(m / "pytorch_model.bin")
    return m, Expect(ModelFormatError, (str(m), "only safetensors"))


def case_not_a_checkpoint_file(m: Path) -> tuple[Path, Expect]:
    return m / "config.json", Expect(ModelFormatError, (str(m / "config.json"),))


def case_truncated_data(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    header, start = read_header(path)
    cut = start + (path.stat().st_size - start) // 2
    cut_tensor = next(name for name, spec in header.items() if name != "__metadata__"
                      and start + spec["data_offsets"][0] <= cut < start + spec["data_offsets"][1])
    with open(path, "r+b") as f:
        f.truncate(cut)
    return m, Expect(ModelFormatError, (str(path), "truncated", cut_tensor))


def case_truncated_header(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(100)
    return m, Expect(ModelFormatError, (str(path), "truncated"))


def case_truncated_length(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(5)
    return m, Expect(ModelFormatError, (str(path), "truncated"))


def case_empty_file(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    path.write_bytes(b"")
    return m, Expect(ModelFormatError, (str(path), "truncated"))


def case_bad_header_json(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"{{{x"
    path.write_bytes(bytes(data))
    return m, Expect(ModelFormatError, (str(path), "header JSON"))


def case_header_not_object(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    header = b"[1, 2, 3]     "
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return m, Expect(ModelFormatError, (str(path), "header"))


def case_header_entry_inconsistent(m: Path) -> tuple[Path, Expect]:
    path = m / "model.safetensors"
    header, start = read_header(path)
    header["model.norm.weight"]["shape"] = [65]                     # bytes no longer match the shape
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + path.read_bytes()[start:])
    return m, Expect(ModelFormatError, (str(path), "model.norm.weight"))


def case_unsupported_tensor_dtype(m: Path) -> tuple[Path, Expect]:
    rewrite_tensors(m, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].astype(np.float64)))
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), "model.norm.weight", "F64"))


def case_tensor_missing(m: Path) -> tuple[Path, Expect]:
    rewrite_tensors(m, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), "model.layers.1.mlp.up_proj.weight", "missing"))


def case_tensor_shape(m: Path) -> tuple[Path, Expect]:
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_tensors(m, lambda t: t.__setitem__(name, t[name][:, :60].copy()))
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), name, "[64, 60]", "[64, 64]"))


def case_config_shape(m: Path) -> tuple[Path, Expect]:
    edit_config(m, intermediate_size=100)
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), "model.layers.0.mlp.gate_proj.weight",
                                        "config.json"))


def case_tensor_dtype(m: Path) -> tuple[Path, Expect]:
    edit_config(m, dtype="bfloat16")
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), "model.embed_tokens.weight", "f32", "bf16"))


def case_tensor_dtype_torch_dtype_key(m: Path) -> tuple[Path, Expect]:
    """Older transformers write ``torch_dtype``."""
    edit_config(m, dtype=..., torch_dtype="float16")
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), "model.embed_tokens.weight", "f16"))


def case_one_tensor_of_another_dtype(m: Path) -> tuple[Path, Expect]:
    name = "model.layers.1.post_attention_layernorm.weight"
    rewrite_tensors(m, lambda t: t.__setitem__(name, t[name].astype(np.float16)))
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), name, "f16"))


def case_unknown_architecture(m: Path) -> tuple[Path, Expect]:
    edit_config(m, model_type="mamba", architectures=["MambaForCausalLM"])
    return m, Expect(UnsupportedError, (str(m / "config.json"), "mamba", "llama"))


def case_missing_model_type(m: Path) -> tuple[Path, Expect]:
    edit_config(m, model_type=...)
    return m, Expect(UnsupportedError, (str(m / "config.json"), "model_type"))


def case_unsupported_activation(m: Path) -> tuple[Path, Expect]:
    edit_config(m, hidden_act="relu")
    return m, Expect(UnsupportedError, (str(m / "config.json"), "relu"))


def case_unsupported_rope(m: Path) -> tuple[Path, Expect]:
    edit_config(m, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0})
    return m, Expect(UnsupportedError, (str(m / "config.json"), "longrope"))


def case_config_bad_json(m: Path) -> tuple[Path, Expect]:
    (m / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    return m, Expect(ModelFormatError, (str(m / "config.json"), "malformed JSON"))


def case_config_not_object(m: Path) -> tuple[Path, Expect]:
    (m / "config.json").write_text('["llama"]')
    return m, Expect(ModelFormatError, (str(m / "config.json"), "object"))


def case_config_missing_field(m: Path) -> tuple[Path, Expect]:
    edit_config(m, hidden_size=...)
    return m, Expect(ModelFormatError, (str(m / "config.json"), "hidden_size"))


def case_config_bad_field(m: Path) -> tuple[Path, Expect]:
    edit_config(m, num_attention_heads="four")
    return m, Expect(ModelFormatError, (str(m / "config.json"), "num_attention_heads", "four"))


def case_config_bad_optional_field(m: Path) -> tuple[Path, Expect]:
    edit_config(m, num_key_value_heads="two")
    return m, Expect(ModelFormatError, (str(m / "config.json"), "num_key_value_heads"))


def case_config_fractional_field(m: Path) -> tuple[Path, Expect]:
    edit_config(m, hidden_size=64.5)
    return m, Expect(ModelFormatError, (str(m / "config.json"), "hidden_size", "64.5"))


def case_config_null_required_field(m: Path) -> tuple[Path, Expect]:
    edit_config(m, vocab_size=None)
    return m, Expect(ModelFormatError, (str(m / "config.json"), "vocab_size"))


def case_config_bad_eps(m: Path) -> tuple[Path, Expect]:
    edit_config(m, rms_norm_eps="tiny")
    return m, Expect(ModelFormatError, (str(m / "config.json"), "rms_norm_eps", "tiny"))


def case_config_bad_rope_theta(m: Path) -> tuple[Path, Expect]:
    edit_config(m, rope_parameters={"rope_type": "default", "rope_theta": "big"})
    return m, Expect(ModelFormatError, (str(m / "config.json"), "rope_theta", "big"))


def case_config_heads_not_multiple_of_kv_heads(m: Path) -> tuple[Path, Expect]:
    edit_config(m, num_key_value_heads=3)
    return m, Expect(ModelFormatError, (str(m / "config.json"), "num_key_value_heads=3"))


def case_gpt2_heads_do_not_divide(m: Path) -> tuple[Path, Expect]:
    edit_config(m, n_head=5)
    return m, Expect(ModelFormatError, (str(m / "config.json"), "n_head=5"))


def case_gpt2_conv1d_not_transposed(m: Path) -> tuple[Path, Expect]:
    """GPT-2's Conv1D stores [in, out]; a checkpoint with nn.Linear's [out, in] is caught."""
    name = "transformer.h.0.mlp.c_fc.weight"
    rewrite_tensors(m, lambda t: t.__setitem__(name, t[name].T.copy()))
    return m, Expect(ModelFormatError, (str(m / "model.safetensors"), name, "[256, 64]", "[64, 256]"))


def _shard(m: Path) -> Path:
    """Split the checkpoint into two shards with an index."""
    tensors = load_file(m / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, m / shard, metadata={"format": "pt"})
    (m / "model.safetensors").unlink()
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return m


def case_shard_missing(m: Path) -> tuple[Path, Expect]:
    (_shard(m) / "model-00002-of-00002.safetensors").unlink()
    return m, Expect(ModelFormatError, (str(m / "model-00002-of-00002.safetensors"), "no such file or directory"))


def case_shard_index_bad_json(m: Path) -> tuple[Path, Expect]:
    (_shard(m) / "model.safetensors.index.json").write_text("{")
    return m, Expect(ModelFormatError, (str(m / "model.safetensors.index.json"),))


def case_shard_index_lists_absent_tensor(m: Path) -> tuple[Path, Expect]:
    index = _shard(m) / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    return m, Expect(ModelFormatError, (str(index), "model.extra.weight"))


def case_sharded_tensor_missing(m: Path) -> tuple[Path, Expect]:
    index = _shard(m) / "model.safetensors.index.json"
    shard = m / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    doc = json.loads(index.read_text())
    del doc["weight_map"][name]
    index.write_text(json.dumps(doc))
    return m, Expect(ModelFormatError, (str(index), name, "missing"))


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.fixture
def broken(synthetic_checkpoint, tmp_path: Path, request) -> tuple[Path, Expect]:
    model = tmp_path / "model"
    shutil.copytree(synthetic_checkpoint("tiny-gpt2" if request.param.startswith("gpt2") else "tiny-llama"), model)
    return CASES[request.param](model)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_good_checkpoint_imports(synthetic_checkpoint, preset: str) -> None:
    """The starting points of the cases are fine."""
    assert len(import_hf(synthetic_checkpoint(preset)).nodes) > 0


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_error_names_the_file(broken: tuple[Path, Expect]) -> None:
    path, expect = broken
    with pytest.raises(InfengError) as info:
        import_hf(path)
    message = str(info.value)
    assert type(info.value) is expect.error, f"{type(info.value).__name__}: {message}"
    for needle in expect.mentions:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert "\n" not in message


@pytest.mark.parametrize("broken", list(CASES), indirect=True)
def test_cli_exits_2_with_one_line(broken: tuple[Path, Expect]) -> None:
    from typer.testing import CliRunner

    from infeng_cli.main import app

    path, expect = broken
    result = CliRunner().invoke(app, ["ir", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for needle in expect.mentions:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def test_cli_subprocess_exit_code(tmp_path: Path) -> None:
    """The installed entry point, outside CliRunner: exit code 2, one line on stderr."""
    import subprocess
    import sys

    code = "import sys; from infeng_cli.main import app; sys.argv = ['infeng', 'ir', sys.argv[1]]; app()"
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "absent")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1
    assert str(tmp_path / "absent") in result.stderr and "Traceback" not in result.stderr


def test_cli_prints_the_message_verbatim(tmp_path: Path) -> None:
    """A path with brackets is printed as is (the message is text, not console markup)."""
    from typer.testing import CliRunner

    from infeng_cli.main import app

    missing = tmp_path / "[red]" / "[x]model"
    result = CliRunner().invoke(app, ["ir", str(missing)])
    assert result.exit_code == 2
    assert str(missing) in result.stderr, result.stderr


@pytest.mark.parametrize("command", [["run", "{p}", "hi"], ["bench", "{p}"], ["verify", "{p}"], ["chat", "{p}"],
                                     ["serve", "{p}"], ["compile", "{p}", "-o", "{p}.out"], ["ir", "{p}"]])
def test_a_missing_path_is_no_such_file_before_any_format_check(tmp_path: Path, command: list[str]) -> None:
    from typer.testing import CliRunner

    from infeng_cli.main import app

    missing = tmp_path / "absent.infeng"
    result = CliRunner().invoke(app, [arg.format(p=missing) for arg in command])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == f"error: {missing}: no such file or directory"
    assert "manifest" not in result.stderr


@pytest.mark.parametrize("command", [["run", "{p}", "hi"], ["bench", "{p}"], ["verify", "{p}"], ["chat", "{p}"],
                                     ["serve", "{p}"], ["compile", "{p}", "-o", "out"], ["ir", "{p}"],
                                     ["export", "{p}", "-o", "x.gguf"], ["eval", "{p}", "--ppl", "x.txt"]])
def test_a_name_past_the_file_name_limit_is_one_line(command: list[str]) -> None:
    """A model argument longer than NAME_MAX (255 bytes): the OS's refusal as one line, exit 2."""
    from typer.testing import CliRunner

    from infeng_cli.main import app

    name = "m" * 300
    result = CliRunner().invoke(app, [arg.format(p=name) for arg in command])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {name}") and "too long" in last
    assert "Traceback" not in result.output


def test_an_os_error_keeps_the_path_as_named(capsys):
    """Only strerror's first letter is lowered; the path, and a message without strerror, keep
    their case."""
    import typer

    from infeng_cli.app import fails_cleanly

    def raises(error: OSError):
        @fails_cleanly
        def command():
            raise error
        with pytest.raises(typer.Exit):
            command()
        return capsys.readouterr().err

    assert raises(PermissionError(13, "Permission denied", "/Data/My Model.gguf")) == \
        "error: /Data/My Model.gguf: permission denied\n"
    no_strerror = OSError("Name Too Long for THIS")
    no_strerror.filename = "/Data/X"
    assert raises(no_strerror) == "error: /Data/X: Name Too Long for THIS\n"

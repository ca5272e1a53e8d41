"""Hub ids as model arguments, offline: a Hugging Face cache laid out by the test (``models--org--name``
with ``refs/`` and ``snapshots/<commit>/``), ``HF_HUB_CACHE`` pointing at it and ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.frontends import import_model, model_source
from infeng_compiler.frontends.hub import HubId, HubModelError, parse_hub_id, resolve_model_path
from infeng_compiler.ir import print_graph

MAIN, V2, SYNTH = "a" * 40, "b" * 40, "c" * 40
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def lay_out(cache: Path, repo_id: str, commits: dict[str, Path], refs: dict[str, str]) -> None:
    """``repo_id``'s cache folder as huggingface_hub writes it: a snapshot per commit, refs naming commits."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for commit, source in commits.items():
        shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, hf_checkpoint, synthetic_checkpoint, stories_dir) -> Path:
    root = tmp_path_factory.mktemp("hub")
    tiny = root / "src" / "tiny"
    shutil.copytree(hf_checkpoint("llama"), tiny)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(stories_dir / name, tiny / name)
    (tiny / "chat_template.jinja").write_text(TEMPLATE)
    lay_out(root / "cache", "infeng-test/tiny", {MAIN: tiny, V2: hf_checkpoint("qwen2")}, {"main": MAIN, "v2": V2})
    lay_out(root / "cache", "infeng-test/tiny-synth", {SYNTH: synthetic_checkpoint("tiny-llama")}, {"main": SYNTH})
    return root / "cache"


@pytest.fixture
def offline(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)          # no relative path infeng-test/... here
    return cache


def snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


@pytest.mark.parametrize("text, want", [
    ("org/name", HubId("org/name")),
    ("HuggingFaceTB/SmolLM2-135M-Instruct@main", HubId("HuggingFaceTB/SmolLM2-135M-Instruct", "main")),
    ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
    ("org/name-GGUF/model.Q4_0.gguf@" + MAIN, HubId("org/name-GGUF", MAIN, "model.Q4_0.gguf")),
    ("name", None), ("./org/name", None), ("/abs/org/name", None), ("org/name/weights.bin", None),
    ("nope/model.gguf", None), ("org/name.safetensors", None), ("org/model.onnx", None), ("~/org/name", None),
    ("../org/name", None), ("org/name/sub/model.Q4_0.gguf", HubId("org/name", None, "sub/model.Q4_0.gguf")),
    ("org//name", None), ("org/name@", None), ("org/..", None), ("-org/name", None), ("org/name@has space", None),
])
def test_parse_hub_id(text: str, want: HubId | None) -> None:
    assert parse_hub_id(text) == want


def test_hub_id_imports_the_cached_snapshot(offline: Path) -> None:
    graph = import_model("infeng-test/tiny")
    local = import_model(snapshot(offline, "infeng-test/tiny", MAIN))
    assert graph.name == "tiny" and local.name == MAIN and graph.meta["family"] == "llama"
    local.name = graph.name
    assert print_graph(graph) == print_graph(local)
    source = model_source("infeng-test/tiny")
    assert source.path == snapshot(offline, "infeng-test/tiny", MAIN) == source.tokenizer_dir


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision(offline: Path, revision: str) -> None:
    assert import_model(f"infeng-test/tiny@{revision}").meta["family"] == "qwen2"
    assert model_source(f"infeng-test/tiny@{revision}").path == snapshot(offline, "infeng-test/tiny", V2)


@pytest.mark.parametrize("model", ["infeng-test/absent", "infeng-test/tiny@v3"])
def test_missing_model_is_one_clear_line(offline: Path, model: str) -> None:
    with pytest.raises(HubModelError) as info:
        import_model(model)
    message = str(info.value)
    assert message.startswith(model) and "\n" not in message
    assert f"not in the local cache (HF_HUB_CACHE={offline})" in message and "cannot be reached" in message
    result = CliRunner().invoke(app, ["ir", model])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"error: {message}"]


@pytest.mark.parametrize("command", ["chat", "serve", "compile", "ir"])
@pytest.mark.parametrize("model", ["./nope/model.gguf", "nope/model.gguf", "./org/name", "../org/name", "model.gguf",
                                   "./nope", "nope.onnx", "nope/model.safetensors"])
def test_a_missing_local_path_never_reaches_the_hub(command: str, model: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail(f"hub asked for {a} {k}"))
    args = [command, model] + (["-o", str(tmp_path / "out.infeng")] if command == "compile" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {model}: no such file or directory\n"        # no blank line before it


def test_an_existing_path_wins(offline: Path, tmp_path: Path) -> None:
    local = tmp_path / "infeng-test" / "tiny"
    shutil.copytree(snapshot(offline, "infeng-test/tiny", V2), local)
    assert resolve_model_path("infeng-test/tiny") == Path("infeng-test/tiny")
    assert import_model("infeng-test/tiny").meta["family"] == "qwen2"
    shutil.rmtree(local)
    assert import_model("infeng-test/tiny").meta["family"] == "llama"


def test_download_when_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf_checkpoint) -> None:
    """Not cached and online: snapshot_download fetches the files infeng reads; a failure is one line."""
    import huggingface_hub

    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_download(repo_id, *, revision, cache_dir, allow_patterns, local_files_only=False):
        calls.append((repo_id, revision, local_files_only))
        folder = snapshot(Path(cache_dir), repo_id, MAIN)
        if local_files_only and not folder.is_dir():
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        if not local_files_only:
            if repo_id == "infeng-test/unreachable":
                raise ConnectionError("Failed to resolve 'huggingface.co'\n(more detail)")
            assert "*.safetensors" in allow_patterns and "tokenizer.json" in allow_patterns
            lay_out(Path(cache_dir), repo_id, {MAIN: hf_checkpoint("llama")}, {"main": MAIN})
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert import_model("infeng-test/fresh").meta["family"] == "llama"
    assert calls == [("infeng-test/fresh", None, True), ("infeng-test/fresh", None, False)]
    calls.clear()
    assert import_model("infeng-test/fresh").meta["family"] == "llama"        # from the cache now
    assert calls == [("infeng-test/fresh", None, True)]
    with pytest.raises(HubModelError, match=r"cannot be reached: ConnectionError: Failed to resolve 'huggingface.co' "
                                            r"\(more detail\)$"):
        import_model("infeng-test/unreachable")


def test_cli_commands_take_hub_ids(offline: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["ir", "infeng-test/tiny@v2"])
    assert result.exit_code == 0, result.output
    assert "graph @tiny" in result.stdout and "linear(" in result.stdout
    local = str(snapshot(offline, "infeng-test/tiny-synth", SYNTH))
    outputs = [runner.invoke(app, ["generate", model, "hello", "-n", "4", "--json"]) for model in
               ("infeng-test/tiny-synth", local)]
    assert all(r.exit_code == 0 for r in outputs), [r.output for r in outputs]
    hub, direct = (json.loads(r.stdout) for r in outputs)
    assert (hub["prompt_tokens"], hub["token_ids"]) == (direct["prompt_tokens"], direct["token_ids"])


def test_compile_from_hub_id(offline: Path, tmp_path: Path) -> None:
    """The artifact of a hub id: named after the repository, tokenizer files and chat_template.jinja copied."""
    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_runtime.engine import Engine

    artifact = tmp_path / "tiny.infeng"
    compile_model("infeng-test/tiny", artifact, CompileOptions(max_tokens=16))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["name"] == "tiny"
    assert manifest["source"]["model_dir"] == str(snapshot(offline, "infeng-test/tiny", MAIN).resolve())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (artifact / name).is_file(), name
    assert Engine(artifact).tokenizer.chat_template == TEMPLATE

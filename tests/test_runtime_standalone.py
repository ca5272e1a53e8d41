"""The runtime serves a compiled artifact alone: importing the server, the offline API and the
engine loads nothing of the compiler (nor networkx, onnx, or the compiler's templates), and the
Engine reads the C ABI from the header shipped in the artifact."""
from __future__ import annotations

import json
import subprocess
import sys

COMPILER_SIDE = ("infeng_compiler", "infeng_templates", "networkx", "onnx")


def test_runtime_imports_no_compiler_module():
    script = (
        "import sys, json\n"
        "import infeng_runtime.server, infeng_runtime.llm, infeng_runtime.engine\n"
        "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert not [m for m in loaded if m.split(".")[0] in COMPILER_SIDE]
    assert "infeng_common" in loaded


def test_engine_serves_an_artifact_without_the_compiler(tmp_path, stories_dir):
    from infeng_compiler.compile import CompileOptions, compile_model

    artifact = tmp_path / "stories.infeng"
    compile_model(stories_dir, artifact, CompileOptions(target="scalar"))
    script = (
        "import sys, json\n"
        "from infeng_runtime.llm import LLM\n"
        "from infeng_runtime.sampling import SamplingParams\n"
        f"llm = LLM({str(artifact)!r}, threads=1, max_seqs=2)\n"
        "c = llm.generate(['Once upon a time'], SamplingParams(max_new_tokens=8))[0]\n"
        "print(json.dumps({'text': c.text, 'modules': sorted(sys.modules)}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["text"] and not [m for m in result["modules"] if m.split(".")[0] in COMPILER_SIDE]

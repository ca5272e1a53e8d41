"""What a user can ask of the runtime at load time is bounded before anything is allocated: a
context or sequence count whose KV pool cannot fit in memory is one line and exit code 2; the
model's own ``max_position_embeddings`` is cut to what the default pool holds (tests/test_kv_memory.py).
Adapters with non-finite weights or scales are refused at load, naming the tensor."""
from __future__ import annotations

import json
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from _serving import infeng_command, served_artifact, write_adapter
from infeng_common.errors import ModelFormatError
from infeng_runtime.adapters import AdapterError
from infeng_runtime.engine import Engine


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("limits-artifact"))


@pytest.mark.parametrize("args, mentions", [
    (["--max-context", "1000000000"], "memory available"),
    (["--max-seqs", "100000000", "--max-context", "512"], "memory available"),
    (["--kv-memory", "64KiB", "--max-context", "4096"], "does not fit in the KV pool"),
])
def test_serve_refuses_a_pool_that_cannot_fit(artifact, args, mentions):
    started = time.monotonic()
    out = subprocess.run([*infeng_command(), "serve", str(artifact), "--port", "1", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert mentions in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 30


def test_model_context_is_cut_to_the_pool_not_refused(artifact, tmp_path):
    copy = tmp_path / "huge-context.infeng"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["meta"]["max_position_embeddings"] = 10 ** 12
    (copy / "manifest.json").write_text(json.dumps(manifest))
    engine = Engine(copy, threads=1, max_seqs=2)           # the default pool: a share of the memory available
    assert engine.max_context == engine.kv.n_blocks * engine.block_size < 10 ** 12
    engine = Engine(copy, threads=1, max_seqs=2, kv_memory=1 << 20)   # a pool given: the context fits it
    assert engine.max_context == engine.kv.n_blocks * engine.block_size


def test_block_free_list_is_not_materialised(artifact):
    engine = Engine(artifact, threads=1, max_seqs=2, max_context=64, kv_blocks=1 << 16)
    assert engine.kv.free_blocks == [] and engine.kv.num_free == 1 << 16
    engine.kv.ensure(0, 40)
    assert engine.kv.blocks_of[0] == [0, 1, 2] and engine.kv.num_free == (1 << 16) - 3
    engine.kv.free(0)
    assert engine.kv.num_free == 1 << 16


def test_adapters_with_non_finite_weights_or_scale_are_refused(artifact, tmp_path):
    engine = Engine(artifact, threads=1, max_seqs=1)
    good = write_adapter(tmp_path / "good", seed=1)
    with pytest.raises(AdapterError, match="scale must be a finite number"):
        engine.load_adapter("nan-scale", good, scale=float("nan"))
    bad = tmp_path / "nan"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    name = "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"
    tensors[name][3, 1] = np.nan
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(ModelFormatError, match=f"tensor {name} has non-finite values"):
        engine.load_adapter("nan-weights", bad)
    assert engine.adapters.served == {}
    assert engine.load_adapter("good", good) == 0

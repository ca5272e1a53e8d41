"""The engine loop survives what its callers do: a command whose caller gave up is skipped, an
adapter unloaded between a request's checks is a 404 for that request, adapter files are read
without the loop's lock, and a loop that stops answers the commands it will not run."""
from __future__ import annotations

import threading
import time

import pytest

from _serving import adapters, served_artifact
from infeng_runtime.engine import Engine
from infeng_runtime.loop import EngineLoop, EngineStopped
from infeng_runtime.sampling import SamplingParams
from infeng_runtime.scheduler import Request, RequestError


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("loop-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("loop-adapters"))


def finished(loop: EngineLoop, prompt: list[int], adapter: str | None = None, rid: str = "r") -> list:
    done, outs = threading.Event(), []

    def sink(batch):
        outs.extend(batch)
        if any(o.finish_reason for o in batch):
            done.set()

    loop.submit(Request(rid, prompt, SamplingParams(max_new_tokens=4), adapter=adapter, sink=sink))
    assert done.wait(30)
    return outs


def test_a_cancelled_command_is_skipped_and_the_loop_lives(artifact):
    loop = EngineLoop(Engine(artifact, threads=1, max_seqs=2))
    loop._thread = threading.current_thread()           # queue without running, as a busy loop would
    ran = []
    cancelled = loop.call(lambda: ran.append(1))
    assert cancelled.cancel()
    loop._thread = None
    loop.start()
    try:
        assert [o.token for o in finished(loop, [1, 5, 9]) if o.token is not None]
        assert loop.alive and loop.error is None and not ran
    finally:
        loop.stop()


def test_an_adapter_unloaded_before_admission_is_a_404(artifact, adapter_dirs):
    loop = EngineLoop(Engine(artifact, threads=1, max_seqs=2)).start()
    try:
        loop.load_adapter("a1", adapter_dirs["a1"]).result(30)
        loop.unload_adapter("a1").result(30)
        with pytest.raises(RequestError, match="'a1' does not exist") as caught:
            loop.submit(Request("late", [1, 5], SamplingParams(max_new_tokens=2), adapter="a1"))
        assert caught.value.status == 404
        assert loop.alive
    finally:
        loop.stop()


def test_each_process_gives_an_adapter_its_own_prefix_namespace(artifact, adapter_dirs):
    """Two servers (a restart) loading the same name get different prefix-cache namespaces, so a
    prefix cache saved by one (--prefix-cache-dir) never hands the other's adapter its K/V."""
    namespaces = []
    for _ in range(2):
        loop = EngineLoop(Engine(artifact, threads=1, max_seqs=2)).start()
        try:
            loop.load_adapter("a1", adapter_dirs["a1"]).result(30)
            namespaces.append(loop.adapters.served["a1"].namespace)
        finally:
            loop.stop()
    assert namespaces[0] != namespaces[1]
    assert all(n.startswith("a1#") for n in namespaces)


def test_adapter_files_are_read_without_the_loop_lock(artifact, adapter_dirs, monkeypatch):
    engine = Engine(artifact, threads=1, max_seqs=2)
    loop = EngineLoop(engine).start()
    real_read, reading = engine.adapters.read, threading.Event()

    def slow_read(*args):
        reading.set()
        time.sleep(1.0)
        return real_read(*args)

    monkeypatch.setattr(engine.adapters, "read", slow_read)
    try:
        loading = loop.load_adapter("a2", adapter_dirs["a2"])
        assert reading.wait(10)
        started = time.monotonic()
        assert loop.lock.acquire(timeout=0.5)            # not held while the files are read
        loop.lock.release()
        assert finished(loop, [1, 7, 3])                 # and steps go on
        assert time.monotonic() - started < 1.0
        assert loading.result(30) >= 0 and "a2" in engine.adapters.served
    finally:
        loop.stop()


def test_a_stopped_loop_answers_queued_commands(artifact):
    loop = EngineLoop(Engine(artifact, threads=1, max_seqs=2))
    loop._thread = threading.current_thread()
    queued = loop.call(lambda: 1)
    loop._thread = None
    loop.stop()
    with pytest.raises(EngineStopped):
        queued.result(5)
    with pytest.raises(EngineStopped):
        loop.submit(Request("after", [1], SamplingParams(max_new_tokens=1)))

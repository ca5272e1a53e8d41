"""``infeng serve-ray``: infeng replicas on a local Ray Serve cluster, driven by the official
``openai`` client, checked against ``infeng serve`` on the same artifact (greedy outputs equal).

One Ray cluster serves the module: 2 engine replicas x 1 thread, room for 1 adapter each. The
references come first, from one ``infeng serve`` subprocess, so the two never compete for the
machine's cores. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _serving import ADAPTER_NAMES, adapters, free_port, infeng_command, running_server, served_artifact

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from ray import serve

from infeng_runtime.ray_serve import ENGINE_DEPLOYMENT, RayServeConfig, app_builder
from infeng_runtime.server import ServeOptions

APP = "infeng-test"
PROMPTS = [f"Once upon a time, {name} went to the" for name in
           ("Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia")] * 4         # 32 requests
STREAM_TOKENS = 24
ADAPTER_PROMPTS = ["Once upon a time", "The little dog"]
CHAT = [{"role": "system", "content": "You tell short stories."}, {"role": "user", "content": "Tell me about a cat."}]
KILL_STREAMS = 12
KILL_TOKENS = 320
REQUEST_TIMEOUT_S = 120.0
STARTUP_S = 240.0


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("ray-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("ray-adapters"))


@pytest.fixture(scope="module")
def references(artifact, adapter_dirs, tmp_path_factory) -> dict[tuple[str, str, int], str]:
    """Greedy texts from ``infeng serve`` for every (model, prompt, max_tokens) the tests send."""
    args = [a for name, path in adapter_dirs.items() for a in ("--adapter", f"{name}={path}")]
    wanted = [("stories260K", p, STREAM_TOKENS) for p in dict.fromkeys(PROMPTS)]
    wanted += [(name, p, STREAM_TOKENS) for name in ADAPTER_NAMES for p in ADAPTER_PROMPTS]
    wanted += [("stories260K", p, KILL_TOKENS) for p in dict.fromkeys(PROMPTS)]
    out = {}
    with running_server(artifact, *args, "--max-seqs", "8", log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        for model, prompt, n in wanted:
            got = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True})
            out[(model, prompt, n)] = got.choices[0].text
        for model in ("stories260K", ADAPTER_NAMES[0]):
            chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=STREAM_TOKENS, temperature=0)
            out[(model, "chat", STREAM_TOKENS)] = chat.choices[0].message.content
    return out


def test_replicas_import_no_compiler_module():
    """What a replica imports (this module, ray, the server) loads nothing of the compiler."""
    script = "import sys, json\nimport infeng_runtime.ray_serve\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not [m for m in json.loads(out.stdout) if m.split(".")[0] in ("infeng_compiler", "infeng_templates")]


def test_cli_refuses_bad_input_in_one_line(artifact):
    """Before any cluster starts: a bad flag is one line naming it, exit 2."""
    out = subprocess.run([*infeng_command(), "serve-ray", str(artifact), "--replicas", "2", "--min-replicas", "3",
                          "--max-replicas", "4"], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--replicas 2" in out.stderr


@pytest.mark.slow
def test_cli_serves_and_stops_on_sigterm(artifact, tmp_path):
    """``infeng serve-ray ARTIFACT`` starts its own Ray cluster, answers, and exits 0 on SIGTERM
    (run first: the module's cluster starts after it)."""
    port = free_port()
    log = tmp_path / "serve-ray.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([*infeng_command(), "serve-ray", str(artifact), "--replicas", "1", "--port", str(port),
                                 "--max-seqs", "4"], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _health(url), 180, lambda: log.read_text()[-3000:])
        got = httpx.post(f"{url}/v1/completions", timeout=60,
                         json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8})
        assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
def test_cli_replicas_that_cannot_load_are_one_line(artifact, tmp_path):
    """An artifact the replicas refuse (here: no tokenizer) ends serve-ray with the replica's reason
    on one line, exit 2."""
    import shutil

    broken = tmp_path / "no-tokenizer.infeng"
    shutil.copytree(artifact, broken)
    (broken / "tokenizer.json").unlink()
    out = subprocess.run([*infeng_command(), "serve-ray", str(broken), "--replicas", "1", "--port", str(free_port())],
                         check=False, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"error: the replicas did not start: {broken}: the artifact has " \
                                                  f"no tokenizer.json; it cannot be served"


@pytest.fixture(scope="module")
def cluster(artifact, adapter_dirs, references, tmp_path_factory):
    """Ray with 2 CPUs for 2 engine replicas x 1 thread; the router, proxy and controller take none.
    Besides the 3 adapters, a declared one whose directory holds no adapter ("broken")."""
    broken = tmp_path_factory.mktemp("broken-adapter")
    (broken / "adapter_config.json").write_text("{}")
    # requests in flight reach the autoscaler every 0.5 s rather than 10 s (the replicas inherit this)
    pushes = {f"RAY_SERVE_{side}_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5" for side in ("HANDLE", "REPLICA")}
    saved = {name: os.environ.get(name) for name in pushes}
    os.environ.update(pushes)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             _metrics_export_port=free_port(), _system_config={"metrics_report_interval_ms": 1000})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # through the entry point of `serve run` config files
        adapters_arg = {**{name: str(path) for name, path in adapter_dirs.items()}, "broken": str(broken)}
        app = app_builder({"artifact": str(artifact), "replicas": 2, "threads_per_replica": 1,
                           "adapters": adapters_arg, "adapters_per_replica": 1, "max_seqs": 16, "host": "127.0.0.1"})
        within(STARTUP_S, lambda: serve.run(app, name=APP, route_prefix="/"))
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def stream_text(client, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(the streamed text, the replica that served it)."""
    raw = await client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True})
    replica = raw.headers.get("x-infeng-replica", "")
    chunks = raw.parse()
    if inspect.isawaitable(chunks):                  # openai < 2 returns a coroutine
        chunks = await chunks
    text = "".join([c.choices[0].text async for c in chunks if c.choices])
    return text, replica


def streams(url: str, requests: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
    """The requests (model, prompt, max_tokens) streamed at once by the official async client."""
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:
            return await asyncio.wait_for(asyncio.gather(*(stream_text(client, *r) for r in requests)),
                                          REQUEST_TIMEOUT_S)
    return asyncio.run(run())


@pytest.mark.slow
def test_models_and_health(cluster):
    models = httpx.get(f"{cluster}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["stories260K", *ADAPTER_NAMES, "broken"]
    health = httpx.get(f"{cluster}/health", timeout=30)
    assert health.status_code == 200 and health.json()["replicas"]["running"] == 2


@pytest.mark.slow
def test_32_streams_equal_infeng_serve_on_both_replicas(cluster, references):
    results = streams(cluster, [("stories260K", p, STREAM_TOKENS) for p in PROMPTS])
    for prompt, (text, _) in zip(PROMPTS, results):
        assert text == references[("stories260K", prompt, STREAM_TOKENS)]
    replicas = {replica for _, replica in results}
    assert len(replicas) == 2 and "" not in replicas, f"replicas that answered: {replicas}"


@pytest.mark.slow
def test_chat_streams_equal_infeng_serve(cluster, references):
    async def chat(client, model: str) -> str:
        stream = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=STREAM_TOKENS,
                                                      temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:
            return await asyncio.gather(chat(client, "stories260K"), chat(client, ADAPTER_NAMES[0]))
    base, adapted = asyncio.run(run())
    assert base == references[("stories260K", "chat", STREAM_TOKENS)]
    assert adapted == references[(ADAPTER_NAMES[0], "chat", STREAM_TOKENS)]


@pytest.mark.slow
def test_errors_are_the_same_as_infeng_serve(cluster):
    missing = httpx.post(f"{cluster}/v1/completions", timeout=30,
                         json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(f"{cluster}/v1/completions", timeout=30, json={"model": "stories260K", "prompt": "x",
                                                                   "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    broken = httpx.post(f"{cluster}/v1/completions", timeout=30,
                        json={"model": "broken", "prompt": "x", "max_tokens": 2})
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "adapter_load_failed"
    loads = httpx.post(f"{cluster}/v1/adapters", timeout=30, json={"name": "x", "path": "/tmp"})
    assert loads.status_code == 403 and loads.json()["error"]["code"] == "adapter_loads_disabled"


@pytest.mark.slow
def test_three_adapters_over_two_replicas_with_one_slot_each(cluster, references):
    wanted = [(name, p) for _ in range(2) for name in ADAPTER_NAMES for p in ADAPTER_PROMPTS]
    results = streams(cluster, [(name, p, STREAM_TOKENS) for name, p in wanted])
    for (name, prompt), (text, _) in zip(wanted, results):
        assert text == references[(name, prompt, STREAM_TOKENS)], name
    assert references[("a1", ADAPTER_PROMPTS[0], STREAM_TOKENS)] != references[("a2", ADAPTER_PROMPTS[0],
                                                                                  STREAM_TOKENS)]


@pytest.mark.slow
def test_replica_metrics_through_ray(cluster):
    """Each replica's samples (vLLM's names with ``_`` for ``:``) reach Ray's Prometheus export,
    tagged with the replica."""
    port = ray.nodes()[0]["MetricsExportPort"]
    seen: set[str] = set()

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_vllm_generation_tokens")]
        seen.update(ln.split('replica="')[1].split('"')[0] for ln in lines if 'replica="' in ln)
        return len(seen) >= 2
    wait_for(exported, 90, lambda: f"replicas seen: {seen}")


@pytest.mark.slow
def test_replica_killed_mid_load(cluster, references):
    """Kill an engine replica while 12 long streams run: each completes (its text the reference) or
    ends with an error event then [DONE] (its text a prefix of the reference); none hangs; Ray
    brings the deployment back to 2 running replicas."""
    async def one(prompt: str, first: asyncio.Event) -> tuple[str, dict | None]:
        text, error = "", None
        async with httpx.AsyncClient(base_url=cluster, timeout=REQUEST_TIMEOUT_S) as http:
            body = {"model": "stories260K", "prompt": prompt, "max_tokens": KILL_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return text, json.loads(await r.aread())["error"]
                events = []
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    events.append(line)
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = chunk["error"]
                        continue
                    text += chunk["choices"][0]["text"]
                    first.set()
                assert events[-1] == "data: [DONE]", events[-3:]
        return text, error

    async def run():
        firsts = [asyncio.Event() for _ in range(KILL_STREAMS)]
        tasks = [asyncio.ensure_future(one(PROMPTS[i], firsts[i])) for i in range(KILL_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), REQUEST_TIMEOUT_S)
        victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                      if ENGINE_DEPLOYMENT in a["name"] and a["name"].startswith("SERVE_REPLICA"))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        async with httpx.AsyncClient(base_url=cluster, timeout=REQUEST_TIMEOUT_S) as http:
            late = [http.post("/v1/completions", json={"model": "stories260K", "prompt": p, "temperature": 0,
                                                       "max_tokens": STREAM_TOKENS, "ignore_eos": True})
                    for p in PROMPTS[:4]]       # sent as the replica dies: retried, or a clean 503
            return await asyncio.wait_for(asyncio.gather(asyncio.gather(*tasks), asyncio.gather(*late)),
                                          REQUEST_TIMEOUT_S)

    results, late = asyncio.run(run())
    for prompt, response in zip(PROMPTS[:4], late):
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == references[("stories260K", prompt, STREAM_TOKENS)]
        else:
            assert response.status_code == 503 and response.json()["error"]["code"] == "replica_died"
    errors = 0
    for i, (text, error) in enumerate(results):
        want = references[("stories260K", PROMPTS[i], KILL_TOKENS)]
        if error is None:
            assert text == want
        else:
            errors += 1
            assert error["code"] == "replica_died" and want.startswith(text)
    assert errors < KILL_STREAMS, "the surviving replica's streams should complete"

    def two_running() -> bool:
        deployment = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
        return {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}.get("RUNNING") == 2
    wait_for(two_running, 120, lambda: str(serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]))
    wait_for(lambda: _health(cluster, running=2), 30, lambda: httpx.get(f"{cluster}/health", timeout=30).text)
    after = streams(cluster, [("stories260K", p, STREAM_TOKENS) for p in PROMPTS[:8]])
    assert [t for t, _ in after] == [references[("stories260K", p, STREAM_TOKENS)] for p in PROMPTS[:8]]


def _health(url: str, running: int = 1) -> bool:
    """/health answers 200 with at least ``running`` engine replicas running."""
    try:
        answer = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and answer.json()["replicas"].get("running", 0) >= running


def within(timeout_s: float, fn):
    """``fn()``, failing the test if it has not returned in ``timeout_s`` (serve.run has no timeout)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(f"not done in {timeout_s} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def wait_for(condition, timeout_s: float, describe) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s: {describe()}")
        time.sleep(0.5)


def router_deployment(app):
    return app._bound_deployment


def engine_deployment(app):
    """The engine deployment an application binds (Ray has no public accessor for a bound
    deployment's arguments or its autoscaling config)."""
    return app._bound_deployment.init_args[0]._bound_deployment


def test_app_builder_fixed_and_autoscaling(artifact, adapter_dirs):
    """The ``serve run`` entry point: fixed replicas, or autoscaling on requests in flight."""
    adapters_arg = {name: str(path) for name, path in adapter_dirs.items()}
    fixed = engine_deployment(app_builder({"artifact": str(artifact), "replicas": 3, "threads_per_replica": 2,
                                           "adapters": adapters_arg, "max_seqs": 8}))
    assert fixed.num_replicas == 3 and fixed.max_ongoing_requests == 8
    assert router_deployment(app_builder({"artifact": str(artifact), "router_replicas": 2})).num_replicas == 2
    assert fixed.ray_actor_options["num_cpus"] == 2
    assert fixed.init_args[1].threads == 2 and fixed.init_args[3] == 4           # the artifact's 4 slots
    scaled = engine_deployment(app_builder({"artifact": str(artifact), "replicas": 2, "min_replicas": 1,
                                            "max_replicas": 4, "target_ongoing_requests": 6,
                                            "autoscaling_config": {"upscale_delay_s": 5}}))
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.initial_replicas,
            autoscaling.target_ongoing_requests, autoscaling.upscale_delay_s) == (1, 4, 2, 6, 5)
    with pytest.raises(ValueError, match="bogus"):
        app_builder({"artifact": str(artifact), "replicas": 1, "bogus": 1})


def test_config_refuses_adapters_without_slots(tmp_path, adapter_dirs):
    from _serving import nonfinite_artifact

    from infeng_common.errors import InfengError

    no_slots = nonfinite_artifact(tmp_path)
    with pytest.raises(InfengError, match="no LoRA slots"):
        RayServeConfig(no_slots, ServeOptions(adapters=dict(adapter_dirs))).check()
    with pytest.raises(InfengError, match="--min-replicas"):
        RayServeConfig(no_slots, replicas=5, min_replicas=1, max_replicas=2).check()


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load(cluster, artifact):
    """Last (it replaces the module's application): 1 replica, at most 2, target 2 requests in
    flight per replica; 8 streams at once make Ray start the second replica."""
    serve.delete(APP)
    app = app_builder({"artifact": str(artifact), "replicas": 1, "min_replicas": 1, "max_replicas": 2,
                       "target_ongoing_requests": 2, "max_seqs": 8, "host": "127.0.0.1",
                       "autoscaling_config": {"upscale_delay_s": 0, "look_back_period_s": 2}})
    within(STARTUP_S, lambda: serve.run(app, name=APP, route_prefix="/"))
    loaded = threading.Event()

    def load() -> None:                       # waves of 8 streams until the deployment has grown
        while not loaded.is_set():
            streams(cluster, [("stories260K", p, KILL_TOKENS) for p in PROMPTS[:8]])

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        wait_for(lambda: _health(cluster, running=2), 120,
                 lambda: str(serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]))
    finally:
        loaded.set()
        worker.join(REQUEST_TIMEOUT_S)

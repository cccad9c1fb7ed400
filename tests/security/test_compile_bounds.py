"""A JSON schema under 1 KB whose grammar explodes is bounded in time and memory.

``{"type": "string", "allOf": [{"pattern": "a{1,}"}, ..., {"pattern": "a{24,}"}]}`` makes llguidance intersect
24 regexes when it checks the grammar: 47 s and +4 GB in the process that compiles it (each more pattern doubles
both), so a model replica died of it and the config manager with it. Grammar compiles now run in a worker
process with a memory limit and a wall-clock limit; here the exact schema goes through each real path (the worker
itself, the config manager's admin PUT and its start-up, a model replica's one-off constraint, and the running
app over HTTP) and must come back as a clean 400 naming the limit, with this process's memory and CPU untouched
and the service still serving.

Real parts only: the real tokenizer and model, the embedded Redis, the shared Serve app.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import requests

from config import Limits, ServerSettings
from deployments.protocol import ServiceError
from processors.compile_worker import CompileMemoryExceeded, CompileTimeout, GrammarWorker
from processors.grammar import JSON_OPTIONS

ALLOF_24 = {"type": "string", "allOf": [{"pattern": f"a{{{i},}}"} for i in range(1, 25)]}
SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]}
MEMORY_MB = 512
# Generous bounds of the "did not take minutes / did not eat gigabytes" kind.
MAX_SECONDS = 60
MAX_GROWTH_MB = 200  # this process's peak RSS over the call; unbounded, the compile adds 4+ GB
MAX_CPU_DURING_S = 3.0  # CPU this process spends on the call (the compile is elsewhere; here it took 47 s of CPU)
MAX_CPU_AFTER_S = 0.7  # CPU this process spends in the 2 s after the answer (a compile thread left running: ~2 s)
LIMITED = ("compile_memory_mb", "compile_timeout_s")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Watch:
    """Elapsed time, this process's peak RSS growth (VmHWM reset at the start), its CPU use during the call and in
    the 2 s after."""

    def __enter__(self) -> "Watch":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.rss0 = _status_kb("VmRSS")
        self.t0, self.cpu0 = time.monotonic(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.monotonic() - self.t0
        self.cpu_during = time.process_time() - self.cpu0
        self.growth_mb = (_status_kb("VmHWM") - self.rss0) / 1024
        cpu = time.process_time()
        time.sleep(2.0)
        self.cpu_after = time.process_time() - cpu

    def check(self) -> None:
        assert self.seconds < MAX_SECONDS, f"took {self.seconds:.1f} s"
        assert self.growth_mb < MAX_GROWTH_MB, f"peak RSS grew by {self.growth_mb:.0f} MB"
        assert self.cpu_during < MAX_CPU_DURING_S, f"{self.cpu_during:.1f} s of CPU in this process: it compiled here"
        assert self.cpu_after < MAX_CPU_AFTER_S, f"{self.cpu_after:.2f} s of CPU in the 2 s after the answer: still compiling"


def _names_a_compile_limit(message: str, memory_mb: int = MEMORY_MB) -> None:
    assert f"compile_memory_mb={memory_mb}" in message or "compile_timeout_s" in message, message


# --------------------------------------------------------------------------------------------- the worker


def test_worker_refuses_the_explosion_and_is_replaced(tokenizer):
    worker = GrammarWorker(tokenizer, timeout_s=MAX_SECONDS, memory_mb=MEMORY_MB)
    try:
        assert worker.wait_ready()
        first = worker.pid
        assert worker.build("json_schema", json.dumps(SMALL), JSON_OPTIONS)
        with Watch() as watch, pytest.raises(CompileMemoryExceeded) as error:
            worker.build("json_schema", json.dumps(ALLOF_24), JSON_OPTIONS)
        watch.check()
        assert str(error.value) == f"exceeded the compile memory limit (limits.compile_memory_mb={MEMORY_MB})"
        assert error.value.limit_name == "compile_memory_mb" and error.value.limit == MEMORY_MB
        assert worker.build("regex", "a{3}")  # a fresh worker
        assert worker.pid not in (None, first) and worker.starts == 2
        with pytest.raises(ValueError, match="invalid regex"):  # an ordinary error keeps the worker
            worker.build("regex", "a{3")
        assert worker.starts == 2
    finally:
        worker.close()


def test_worker_is_killed_at_the_timeout(tokenizer):
    worker = GrammarWorker(tokenizer, timeout_s=1.0, memory_mb=4096)  # memory left high: time runs out first
    try:
        assert worker.wait_ready()
        first = worker.pid
        with Watch() as watch, pytest.raises(CompileTimeout) as error:
            worker.build("json_schema", json.dumps(ALLOF_24), JSON_OPTIONS)
        watch.check()
        assert watch.seconds < 10, f"the 1 s timeout took {watch.seconds:.1f} s"
        assert "did not compile within 1 s (limits.compile_timeout_s=1)" in str(error.value)
        assert worker.build("json_schema", json.dumps(SMALL), JSON_OPTIONS)
        assert worker.pid != first
    finally:
        worker.close()


# --------------------------------------------------------------------------------------------- the config manager


@pytest.fixture(scope="module")
def manager(start_manager):
    """The real config manager (embedded Redis, real tokenizer, no replicas) with compile_memory_mb=512."""
    with start_manager("compile-bounds", limits=Limits(compile_memory_mb=MEMORY_MB)) as manager:
        yield manager


def test_admin_put_of_the_schema_is_a_clean_400(manager):
    with Watch() as watch, pytest.raises(ServiceError) as error:
        manager.run(manager.put("allof", {"type": "json_schema", "schema": ALLOF_24}))
    watch.check()
    assert error.value.status == 400, error.value.message
    assert error.value.message.startswith("scenario 'allof' "), error.value.message
    _names_a_compile_limit(error.value.message)
    assert error.value.detail["limit_name"] in LIMITED
    assert not manager.store.versions("allof")  # nothing stored
    assert manager.run(manager.put("small", {"type": "json_schema", "schema": SMALL}))["version"] == 1


def test_a_stored_copy_of_the_schema_does_not_stop_a_manager_from_starting(manager, tokenizer):
    """Another tool wrote the schema to Redis: a manager starting on that store refuses it and serves the rest."""
    from deployments.manager import ConfigManager

    manager.run(manager.put("small-2", {"type": "json_schema", "schema": SMALL}))
    manager.store.put("allof-raw", {"type": "json_schema", "schema": ALLOF_24})  # no compile on this path
    with Watch() as watch:
        second = ConfigManager(manager.settings, tokenizer=tokenizer, redis_client=manager.store.client)
    try:
        watch.check()
        health = manager.run(second.health())
        _names_a_compile_limit(health["errors"]["allof-raw"]["error"])
        assert health["scenarios"]["small-2"] == 1 and "allof-raw" not in health["scenarios"]
    finally:
        manager.run(second.close())
        manager.store.delete("allof-raw")


# --------------------------------------------------------------------------------------------- a model replica


def test_replica_one_off_schema_is_a_clean_400_and_the_replica_serves_on(tokenizer, model):
    from deployments.replica import ModelReplica

    replica = ModelReplica(ServerSettings(limits=Limits(compile_memory_mb=MEMORY_MB)), None, model=model,
                           tokenizer=tokenizer)
    try:
        request = {"inline_scenario": {"type": "json_schema", "schema": ALLOF_24}, "prompt": "x", "max_new_tokens": 4}
        with Watch() as watch, pytest.raises(ServiceError) as error:
            asyncio.run(replica.generate(request))
        watch.check()
        assert error.value.status == 400 and error.value.message.startswith("constraint "), error.value.message
        _names_a_compile_limit(error.value.message)
        if error.value.detail.get("limit_name") == "compile_memory_mb":  # sent again: refused without a compile
            assert replica._grammar_worker.wait_ready()
            pid = replica._grammar_worker.pid
            with pytest.raises(ServiceError) as second:
                asyncio.run(replica.generate(request))
            assert second.value.message == error.value.message
            assert replica._grammar_worker.pid == pid  # the worker was not killed at the limit a second time
        out = asyncio.run(replica.generate({"inline_scenario": {"type": "regex", "pattern": "a{3}"}, "prompt": "x",
                                            "max_new_tokens": 5}))
        assert out["outputs"][0]["text"] == "aaa"
    finally:
        replica.shutdown()


# --------------------------------------------------------------------------------------------- the running app


@pytest.mark.serve
def test_over_http_the_schema_is_a_400_and_no_process_dies(serve_app):
    """Default limits (compile_memory_mb=1024): the OpenAI one-off constraint and the admin PUT both answer 400,
    no model replica or manager process is replaced, and the app serves on."""
    import sys
    from pathlib import Path

    from serve_app import APP_NAME

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench._serve import serve_actors

    def pids() -> dict[str, set[int]]:
        return {d: {int(a["Pid"]) for a in serve_actors(APP_NAME, d)} for d in ("ModelReplica", "ConfigManager")}

    before = pids()
    default_mb = Limits().compile_memory_mb
    chat = {"messages": [{"role": "user", "content": "Say a."}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "allof", "schema": ALLOF_24}}}
    t0 = time.monotonic()
    r = requests.post(f"{serve_app.url}/v1/chat/completions", json=chat, timeout=300)
    assert r.status_code == 400, r.text[:500]
    _names_a_compile_limit(r.json()["error"]["message"], default_mb)
    r = requests.put(f"{serve_app.url}/admin/scenarios/sec-allof", json={"type": "json_schema", "schema": ALLOF_24},
                     headers=serve_app.admin, timeout=300)
    assert r.status_code == 400, r.text[:500]
    _names_a_compile_limit(r.json()["error"]["message"], default_mb)
    assert time.monotonic() - t0 < 2 * MAX_SECONDS
    assert requests.get(f"{serve_app.url}/admin/scenarios/sec-allof/versions", headers=serve_app.admin,
                        timeout=30).status_code == 404
    assert pids() == before  # nothing died
    chat["response_format"]["json_schema"]["schema"] = SMALL
    chat["max_tokens"] = 40
    r = requests.post(f"{serve_app.url}/v1/chat/completions", json=chat, timeout=300)
    assert r.status_code == 200, r.text[:500]

"""VLLMEngine with the real vLLM engine and the default model: every scenario kind through our chain inside
vLLM, mixed in one batch, n > 1 with seeds, streaming order, cancellation, beam search refused, and the same
greedy tokens as the transformers backend.

Every constrained output is checked against its own scenario (``conftest.check_output``).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

from vllm_checks import VLLM_TEST_SETTINGS, Collector, check_output  # noqa: E402
from processors.scenarios import load_scenario  # noqa: E402
from deployments.engines import EngineRequest, ErrorEvent, FinishedEvent, SamplingParams, TokenEvent  # noqa: E402
from deployments.examples import build_phrase_tree, chat_root_token_id  # noqa: E402
from processors import build_prompt_ids, compile_scenario  # noqa: E402

pytestmark = pytest.mark.vllm

LABELS = ["Sports", "Technology", "Politics", "New York City"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def scenario_bodies(tokenizer) -> dict[str, dict]:
    """One body per kind; the tree ends with its own end token ('.'), not EOS."""
    dot = tokenizer.encode(".", add_special_tokens=False)
    assert len(dot) == 1 and dot[0] != tokenizer.eos_token_id
    tree = build_phrase_tree(tokenizer, ["red apple", "green pear", "blue sky at night"],
                             root=chat_root_token_id(tokenizer), end=dot[0])
    return {
        "labels": {"type": "labels", "labels": LABELS},
        "multi": {"type": "labels", "labels": LABELS, "multi_label": True, "separator": ",", "max_labels": 3},
        "tree": {"type": "tree", "tree": tree},
        "schema": {"type": "json_schema", "schema": SCHEMA},
        "json": {"type": "json"},
        "regex": {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"},
        "think-labels": {"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": 6}},
        "think-schema": {"type": "json_schema", "schema": SCHEMA, "think": {"max_thinking_tokens": 5}},
    }


@pytest.fixture(scope="module")
def engine(tokenizer):
    from deployments.engines.vllm import VLLMEngine, model_directory

    eng = VLLMEngine(model_directory(None), tokenizer, max_batch_size=16, max_model_len=2048,
                     kv_cache_gb=VLLM_TEST_SETTINGS["vllm_kv_cache_gb"],
                     enforce_eager=VLLM_TEST_SETTINGS["vllm_enforce_eager"]).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def compiled(tokenizer):
    return {name: compile_scenario(load_scenario(body), tokenizer) for name, body in scenario_bodies(tokenizer).items()}


def _prompt(tokenizer, compiled, text):
    return build_prompt_ids(compiled, tokenizer, messages=[{"role": "user", "content": text}])


def _check_all(tokenizer, bodies, name, finished: dict[int, FinishedEvent], n: int):
    body = bodies[name]
    assert sorted(finished) == list(range(n))
    for ev in finished.values():
        assert ev.error is None, (name, ev)
        text = tokenizer.decode(ev.token_ids, skip_special_tokens=True)
        check_output(body["type"], body, text, ev.token_ids, ev.finish_reason, tokenizer)


def test_every_kind_valid_mixed_in_one_batch(engine, tokenizer, compiled):
    """All kinds (and free text) submitted at once, sampled hot: they share vLLM's batch, each stays valid."""
    bodies = scenario_bodies(tokenizer)
    jobs = []
    for round_ in range(2):
        for name, c in compiled.items():
            col = Collector()
            req = EngineRequest(prompt_ids=_prompt(tokenizer, c, f"Answer ({round_}): a topic, a person, a phone number."),
                                compiled=c, max_new_tokens=48, n=2,
                                sampling=SamplingParams(temperature=1.3, top_p=0.95, seed=100 + round_))
            engine.submit(req, col)
            jobs.append((name, col))
        free = Collector()
        engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, None, "Say something."), compiled=None,
                                    max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=1)), free)
        jobs.append((None, free))
    for name, col in jobs:
        finished = col.wait()
        if name is None:
            ev = finished[0]
            assert ev.finish_reason in ("stop", "length") and ev.error is None and 0 < len(ev.token_ids) <= 16
            continue
        _check_all(tokenizer, bodies, name, finished, 2)
        for index, ev in finished.items():  # streaming: the token events are the output, in order
            assert col.tokens[index] == ev.token_ids


def test_tree_end_token_is_not_eos_and_every_path_is_reached(engine, tokenizer, compiled):
    bodies = scenario_bodies(tokenizer)
    tree = bodies["tree"]["tree"]
    col = Collector()
    engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, compiled["tree"], "Name a thing."), compiled=compiled["tree"],
                                max_new_tokens=12, n=8, sampling=SamplingParams(temperature=3.0, seed=3)), col)
    finished = col.wait()
    _check_all(tokenizer, bodies, "tree", finished, 8)
    assert all(ev.token_ids[-1] == tree["end_token_id"] != tokenizer.eos_token_id for ev in finished.values())


def test_fallback_of_an_incomplete_tree_is_reported_as_by_the_transformers_backend(engine, tokenizer, model):
    """A tree path that reaches a state with no entry: only the end token is left there, the output stops and says
    it fell back, on both backends alike."""
    from deployments.engines.transformers import DecodeEngine

    root = chat_root_token_id(tokenizer)
    ids = tokenizer.encode(" Hello", add_special_tokens=False)
    tree = {"start_token_id": root, "end_token_id": tokenizer.eos_token_id, "prefix_dict": {str(root): ids[:1]}}
    c = compile_scenario(load_scenario({"type": "tree", "tree": tree}), tokenizer)
    reference = DecodeEngine(model, tokenizer, max_batch_size=4).start()
    try:
        outs = []
        for eng in (engine, reference):
            col = Collector()
            eng.submit(EngineRequest(prompt_ids=_prompt(tokenizer, c, "Greet me."), compiled=c, max_new_tokens=8,
                                     sampling=SamplingParams(temperature=1.0, seed=5)), col)
            ev = col.wait()[0]
            outs.append((ev.token_ids, ev.finish_reason, ev.error, ev.fell_back))
    finally:
        reference.stop()
    assert outs[0] == outs[1] == ([ids[0], tokenizer.eos_token_id], "stop", None, True)


def test_seeds_reproduce_and_rows_differ(engine, tokenizer, compiled):
    runs = []
    for _ in range(2):
        col = Collector()
        engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, compiled["json"], "Invent a person as JSON."),
                                    compiled=compiled["json"], max_new_tokens=24, n=4,
                                    sampling=SamplingParams(temperature=1.2, seed=7)), col)
        runs.append({i: ev.token_ids for i, ev in col.wait().items()})
    assert runs[0] == runs[1]
    assert len({tuple(v) for v in runs[0].values()}) > 1, "n rows with one seed must not be copies"


def test_budget_ends_a_grammar_row_with_length_and_no_error(engine, tokenizer, compiled):
    col = Collector()
    engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, compiled["schema"], "A person as JSON."),
                                compiled=compiled["schema"], max_new_tokens=5, sampling=SamplingParams(temperature=0)), col)
    ev = col.wait()[0]
    assert ev.finish_reason == "length" and len(ev.token_ids) == 5 and ev.error is None


def test_greedy_tokens_match_the_transformers_backend(engine, tokenizer, compiled, model):
    """The same prompts, greedy, through both backends: the same tokens (float32 on both)."""
    from deployments.engines.transformers import DecodeEngine

    cases = [("labels", "Topic of: 'the match ended 2-1'"), ("tree", "Name a thing."), ("schema", "A person as JSON."),
             ("regex", "A phone number."), ("think-labels", "Think, then the topic of: 'a new phone'"), (None, "Hi!")]
    reference = DecodeEngine(model, tokenizer, max_batch_size=8).start()
    try:
        for name, text in cases:
            c = compiled[name] if name else None
            outs = []
            for eng in (engine, reference):
                col = Collector()
                eng.submit(EngineRequest(prompt_ids=_prompt(tokenizer, c, text), compiled=c, max_new_tokens=24,
                                         sampling=SamplingParams(temperature=0)), col)
                ev = col.wait()[0]
                outs.append((ev.token_ids, ev.finish_reason))
            assert outs[0] == outs[1], (name, [tokenizer.decode(o[0]) for o in outs])
    finally:
        reference.stop()


def test_cancel_ends_the_request_and_others_go_on(engine, tokenizer, compiled):
    async def run():
        req = EngineRequest(prompt_ids=_prompt(tokenizer, None, "Write a long story."), compiled=None,
                            max_new_tokens=400, sampling=SamplingParams(temperature=1.0, seed=1))
        seen = 0
        async for ev in engine.generate(req):
            if isinstance(ev, TokenEvent):
                seen += 1
                if seen == 3:
                    break  # leaving the loop cancels the request
        return seen

    assert asyncio.run(run()) == 3
    col = Collector()
    ticket = engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, None, "Another long story."), compiled=None,
                                         max_new_tokens=400, sampling=SamplingParams(temperature=1.0, seed=2)), col)
    ticket.cancel()
    assert col.done.wait(120)
    assert any(isinstance(e, ErrorEvent) and e.message == "cancelled" for e in col.events)
    after = Collector()
    engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, compiled["labels"], "Topic: chess"), compiled=compiled["labels"],
                                max_new_tokens=8, sampling=SamplingParams(temperature=0)), after)
    _check_all(tokenizer, scenario_bodies(tokenizer), "labels", after.wait(), 1)
    assert engine.active_rows == 0


def test_one_clients_burst_does_not_queue_another_clients_request_behind_it(engine, tokenizer):
    """vLLM's scheduler serves arrival order; the engine keeps the queue itself (one client's rows fill at most
    ``max_batch_size`` of vLLM's batch, the rest of the burst waits) and keeps a reserve of rows for clients with
    none in, so another client's request starts at once, not after the whole burst (before the gate: after every
    request of the burst had started)."""
    prompt = _prompt(tokenizer, None, "Count from 1 to 100, separated by commas.")
    burst = [Collector() for _ in range(engine.max_batch_size + 8)]
    waited = engine.stats()["waited_requests"]
    for col in burst:
        engine.submit(EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=16, client="burst",
                                    sampling=SamplingParams(temperature=0)), col)
    probe = Collector()
    engine.submit(EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=4, client="probe",
                                sampling=SamplingParams(temperature=0)), probe)
    assert probe.wait(300)[0].token_ids
    for col in burst:
        assert col.wait(300)[0].token_ids
    probe_start = probe.times[0][0]
    started_before = sum(1 for col in burst if col.times[0][0] < probe_start)
    assert started_before <= engine.max_batch_size, started_before
    assert engine.stats()["waited_requests"] - waited >= 8  # the burst's last 8 waited for room
    assert engine.active_rows == 0 and engine.stats()["waiting_requests"] == 0


def test_beam_search_is_refused_with_a_400_naming_the_transformers_backend(engine, tokenizer, compiled):
    from deployments.protocol import ServiceError

    with pytest.raises(ServiceError) as info:
        engine.submit(EngineRequest(prompt_ids=[1, 2, 3], compiled=compiled["labels"], max_new_tokens=4, num_beams=4), Collector())
    assert info.value.status == 400 and "transformers" in info.value.message and isinstance(info.value, ValueError)


def test_guidance_grammar_rows_give_the_same_tokens_as_the_chain(engine, tokenizer, compiled):
    """grammar_backend 'guidance' hands json_schema / regex rows to vLLM's structured outputs with the same
    llguidance grammar: with one seed, the very same tokens as our chain."""
    outs = {}
    for backend in ("chain", "guidance"):
        engine.grammar_backend = backend
        try:
            for name in ("schema", "regex", "json"):
                col = Collector()
                engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, compiled[name], "A person, or a number."),
                                            compiled=compiled[name], max_new_tokens=32, n=2,
                                            sampling=SamplingParams(temperature=1.0, seed=11)), col)
                outs[(backend, name)] = {i: (ev.token_ids, ev.finish_reason, ev.error) for i, ev in col.wait().items()}
        finally:
            engine.grammar_backend = "chain"
    bodies = scenario_bodies(tokenizer)
    for name in ("schema", "regex", "json"):
        assert outs[("chain", name)] == outs[("guidance", name)], name
        for ids, reason, error in outs[("guidance", name)].values():
            assert error is None
            check_output(bodies[name]["type"], bodies[name], tokenizer.decode(ids, skip_special_tokens=True), ids, reason, tokenizer)
    assert engine.stats()["guidance_rows"] >= 6


def test_health_and_stats_are_json(engine):
    health = engine.health()
    assert health["engine"] == "vllm" and health["running"] is True
    json.dumps(health)
    assert health["stats"]["rows"] > 0 and health["stats"]["failed_rows"] == 0


OWNER_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from deployments.model_loader import load_tokenizer
from deployments.engines.vllm import VLLMEngine, model_directory
if __name__ == "__main__":
    eng = VLLMEngine(model_directory(None), load_tokenizer(None), enforce_eager=True, kv_cache_gb=0.25,
                     max_model_len=512).start()
    print("READY", flush=True)
    time.sleep(600)
"""


def test_vllm_processes_end_when_their_replica_is_killed(tmp_path):
    """A replica killed with SIGKILL cannot stop vLLM: its engine core and worker notice and end themselves."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    out = tmp_path / "owner.log"  # vLLM logs to stdout too: a file, not a pipe that could fill up
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while "READY" not in out.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(1)
        assert "READY" in out.read_text(), out.read_text()[-2000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        names = [c.name() for c in children]
        assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.time() + 60
        while time.time() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            time.sleep(0.5)
        left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"vLLM processes left behind: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()

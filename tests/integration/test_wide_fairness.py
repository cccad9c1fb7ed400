"""One-row requests beside wide ones, with the real model and the real engine at its defaults.

(a) memory: requests of several rows together hold at most ``1 - narrow_reserve`` of ``kv_memory_mb``, so a one-row
request is admitted while wide requests fill what they may; (b) steps: a wide request's step is read in chunks of
``wide_step_rows`` rows, the one-row rows in every forward, so a one-row request finishes while a wide request that
started before it is still running. Both are asserted on the order of the engine's events, not on seconds; the
wide requests' outputs stay valid, and chunked beams rank as unchunked ones.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from processors.scenarios import load_scenario
from deployments.engines import EngineRequest, SamplingParams
from deployments.engines.protocol import DoneEvent, ErrorEvent, FinishedEvent, TokenEvent
from deployments.engines.transformers import DecodeEngine
from item_checks import product_tree
from processors import build_prompt_ids, compile_scenario

pytestmark = pytest.mark.integration

CODES = [1000 + 7 * i for i in range(8)]
ROOT = 2000
CATALOG = set(itertools.product(CODES, repeat=3))


@pytest.fixture(scope="module")
def tree(tokenizer):
    tree = {"type": "tree", "tree": product_tree(ROOT, CODES, 3, tokenizer.eos_token_id)}
    return compile_scenario(load_scenario(tree), tokenizer)


class Log:
    """The engine's events of several requests in the order it emitted them (one engine thread emits them all)."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.done: dict[str, threading.Event] = {}
        self.outputs: dict[str, dict[int, list[int]]] = {}

    def collector(self, name: str):
        self.done[name] = threading.Event()
        self.outputs[name] = {}

        def on_event(event):
            self.events.append((name, event))
            if isinstance(event, FinishedEvent):
                self.outputs[name][event.index] = event.token_ids
            if isinstance(event, (DoneEvent, ErrorEvent)):
                self.done[name].set()
        return on_event

    def first(self, name: str, kind) -> int:
        return next(i for i, (n, e) in enumerate(self.events) if n == name and isinstance(e, kind))

    def wait(self, timeout: float = 300) -> None:
        for name, done in self.done.items():
            assert done.wait(timeout), f"{name} did not end"
        errors = [(n, e.message) for n, e in self.events if isinstance(e, ErrorEvent)]
        assert not errors, errors


def _chat(tokenizer, text):
    return build_prompt_ids(None, tokenizer, messages=[{"role": "user", "content": text}])


def _wait_decoding(engine, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while not engine._groups and time.monotonic() < deadline:
        time.sleep(0.002)
    assert engine._groups, "the wide request never started decoding"


def _wide_then_narrow(engine, tokenizer, *, max_new_tokens: int, n: int) -> "Log":
    """128 free-text beams, then, once they decode, a one-row request of 12 tokens; both run to their end."""
    log = Log()
    engine.submit(EngineRequest(prompt_ids=_chat(tokenizer, "Count from 1 to 10000: 1, 2, 3,"), compiled=None,
                                max_new_tokens=max_new_tokens, n=n, num_beams=128,
                                sampling=SamplingParams(temperature=0)), log.collector("wide"))
    _wait_decoding(engine)
    engine.submit(EngineRequest(prompt_ids=_chat(tokenizer, "Count from 1 to 500, separated by commas."),
                                compiled=None, max_new_tokens=12, sampling=SamplingParams(temperature=0)),
                  log.collector("narrow"))
    log.wait()
    return log


def test_a_one_row_request_finishes_while_a_wide_beam_request_runs(model, tokenizer):
    """128 beams of 8 tokens need 7 forwards of 128 rows after their prefill; a one-row request of 12 tokens that
    arrives once they decode used to get one token per beam step (the whole batch in one forward), so it could not
    finish before them. With the wide rows read ``wide_step_rows`` (32) at a time, 28 forwards, it gets a token in
    each of them."""
    engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0).start()
    try:
        log = _wide_then_narrow(engine, tokenizer, max_new_tokens=8, n=4)
        assert len(log.outputs["narrow"][0]) == 12  # it decoded all its tokens (no early end)
        assert log.first("narrow", DoneEvent) < log.first("wide", DoneEvent), \
            "the one-row request only got a token per step of the wide request"
        outputs = log.outputs["wide"]
        assert len(outputs) == 4 and len({tuple(t) for t in outputs.values()}) == 4
    finally:
        engine.stop()


def test_wide_requests_leave_memory_to_one_row_requests(model, tokenizer):
    """Two sampled ``n=8`` requests whose estimates fill ``kv_memory_mb`` but for less than a one-row request needs:
    the second waits (they may take 75%), and the one-row request decodes beside the first instead of waiting for
    one of them to end."""
    engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, kv_memory_mb=40).start()
    try:
        def wide(seed):
            return EngineRequest(prompt_ids=_chat(tokenizer, "Count from 1 to 10000: 1, 2, 3,"), compiled=None,
                                 max_new_tokens=33, n=8, sampling=SamplingParams(temperature=0.7, seed=seed))
        narrow = EngineRequest(prompt_ids=_chat(tokenizer, "Count from 1 to 500, separated by commas."), compiled=None,
                               max_new_tokens=4, sampling=SamplingParams(temperature=0))
        need_wide, need_narrow = engine.job_bytes(wide(0)), engine.job_bytes(narrow)
        # the scenario: both wide requests fit the whole budget together and leave less than the one-row one needs
        assert 2 * need_wide <= engine.kv_budget < 2 * need_wide + need_narrow
        log = Log()
        engine.submit(wide(1), log.collector("wide1"))
        engine.submit(wide(2), log.collector("wide2"))
        _wait_decoding(engine)
        engine.submit(narrow, log.collector("narrow"))
        log.wait()
        first_wide_done = min(log.first("wide1", DoneEvent), log.first("wide2", DoneEvent))
        assert log.first("narrow", TokenEvent) < first_wide_done, "the one-row request waited for a wide one to end"
        assert all(len(out) == 8 for name, out in log.outputs.items() if name.startswith("wide"))
    finally:
        engine.stop()


def test_a_wide_request_over_its_share_is_refused_naming_narrow_reserve(model, tokenizer):
    engine = DecodeEngine(model, tokenizer, kv_memory_mb=40)  # not started: admission_error only reads settings
    prompt = _chat(tokenizer, "Hello")
    wide = EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=80, n=8,
                         sampling=SamplingParams(temperature=1.0))
    assert engine.wide_budget < engine.job_bytes(wide) <= engine.kv_budget
    message = engine.admission_error(wide)
    assert message is not None and "kv_memory_mb=40" in message and "narrow_reserve=0.25" in message
    one_row = EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=64, sampling=SamplingParams())
    assert engine.admission_error(one_row) is None


def test_chunked_beams_rank_as_unchunked(model, tokenizer, tree):
    """The same beam requests with their rows read 5 at a time (several chunks per step, a last short one) and all
    at once: the same outputs."""
    prompts = [_chat(tokenizer, "History: item4 item9. Next?"), _chat(tokenizer, "History: item7. Next?")]
    results = []
    for rows in (5, 0):
        engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, wide_step_rows=rows).start()
        try:
            log = Log()
            for i, (prompt, width) in enumerate(zip(prompts, (16, 12))):
                engine.submit(EngineRequest(prompt_ids=prompt, compiled=tree, max_new_tokens=4, n=width,
                                            num_beams=width, sampling=SamplingParams(temperature=0)),
                              log.collector(f"beams{i}"))
            log.wait()
            results.append(log.outputs)
        finally:
            engine.stop()
    assert results[0] == results[1]
    for outputs in results[0].values():
        items = {tuple(t[:-1]) for t in outputs.values()}
        assert len(items) == len(outputs) and items <= CATALOG


class ForwardSizes:
    """Wraps the engine's model (the real one, called through): for every decode forward of the running batch, the
    one-row rows then in the batch and the rows the forward reads."""

    def __init__(self, engine):
        self.engine, self.model = engine, engine.batch.model
        self.decodes: list[tuple[int, int]] = []
        engine.batch.model = self

    def __call__(self, *args, **kwargs):
        if "cs_step" in kwargs:  # a decode step (prefills carry no step context)
            self.decodes.append((self.engine.batch.narrow_rows, kwargs["input_ids"].shape[0]))
        return self.model(*args, **kwargs)


def test_a_forward_reads_fewer_wide_rows_while_one_row_requests_decode(model, tokenizer):
    """While one-row requests decode, each forward reads at most ``wide_step_rows_shared`` rows of wide requests
    (a forward of 32 more rows cost about six one-row forwards on this CPU, so a one-row request decoding beside
    128 beams got a token at a sixth of its pace); with none in the batch, up to ``wide_step_rows``."""
    engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, wide_step_rows=32, wide_step_rows_shared=8)
    sizes = ForwardSizes(engine)
    engine.start()
    try:
        log = _wide_then_narrow(engine, tokenizer, max_new_tokens=6, n=2)
    finally:
        engine.stop()
    assert len(log.outputs["narrow"][0]) == 12 and len(log.outputs["wide"]) == 2
    beside = [rows - narrow for narrow, rows in sizes.decodes if narrow and rows > narrow]
    alone = [rows for narrow, rows in sizes.decodes if not narrow]
    assert len(beside) >= 11, sizes.decodes  # the one-row request's 11 decode steps each read wide rows too
    assert max(beside) <= 8, sizes.decodes
    assert max(alone) == 32, sizes.decodes  # without one-row rows the wide request is read 32 rows at a time
    assert log.first("narrow", DoneEvent) < log.first("wide", DoneEvent)

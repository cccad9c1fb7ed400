"""A compile past ``compile_timeout_s`` stops.

Before, the caller gave up at the limit but the compile thread ran on: a large label set or a deep tree kept a
core busy for minutes after its 400, and the config manager's two compile threads, once both held by such
compiles, made every later admin write time out too. Now the thread is told to stop and the table builders unwind
at their next checkpoint (``config.cancel``).

The proof that a compile stopped rather than finished unseen: the future of how the thread's call ended (kept
in ``ScenarioCompiler.abandoned``) holds :class:`~config.cancel.CompileStopped`. Without the checkpoints it
would hold the compiled scenario.

Real parts only: the real tokenizer, the real config manager on the embedded Redis.
"""

from __future__ import annotations

import asyncio

import pytest

from config import Limits, ScenarioError
from config.cancel import CompileStopped, checkpoint, stop_scope
from deployments.protocol import ServiceError
from processors import ScenarioCompiler

# ~3 s of compile here (2 cores): far past the limits below, so a compile that is not stopped is seen finishing.
MANY_LABELS = {"type": "labels", "labels": [f"catalog entry {i} of the spring range" for i in range(40_000)]}
SMALL = {"type": "labels", "labels": ["yes", "no"]}
LIMIT_S = 0.3
ENDED_WITHIN_S = 60  # how long to wait for the abandoned thread to report how it ended


def _deep_tree(depth: int) -> dict:
    """An inline tree that is one chain of ``depth`` tokens (its keys grow with the depth: a slow load)."""
    prefix_dict, key = {}, "1000"
    for i in range(depth):
        token = 5 + i % 7
        prefix_dict[key] = [token]
        key = f"{key}_{token}"
    prefix_dict[key] = [2]
    return {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2, "prefix_dict": prefix_dict}}


def _ended_stopped(compiler: ScenarioCompiler) -> None:
    assert compiler.abandoned, "the timed-out compile was not handed over to be stopped"
    outcome = compiler.abandoned[-1]
    exc = outcome.exception(timeout=ENDED_WITHIN_S)
    assert isinstance(exc, CompileStopped), f"the compile past its limit ended with {exc!r}, not stopped"


def test_checkpoint_is_a_no_op_outside_a_compile_and_raises_once_stopped():
    import threading

    checkpoint()  # offline tools and direct calls: nothing to stop
    event = threading.Event()
    with stop_scope(event):
        checkpoint()
        event.set()
        with pytest.raises(CompileStopped):
            checkpoint()
    checkpoint()  # the scope is gone with its block


def test_a_timed_out_label_set_compile_stops(tokenizer):
    compiler = ScenarioCompiler(tokenizer, Limits(compile_timeout_s=LIMIT_S), grammar_worker=None)
    try:
        with pytest.raises(ScenarioError) as error:
            compiler.prepare_blocking(MANY_LABELS)
        assert error.value.kind == "timeout" and error.value.detail["limit_name"] == "compile_timeout_s"
        _ended_stopped(compiler)
        # the compiler is whole: the next compile is served on the same threads
        assert compiler.prepare_blocking(SMALL).constraint is not None
    finally:
        compiler.close()


def test_a_timed_out_deep_tree_compile_stops_on_the_async_path(tokenizer):
    compiler = ScenarioCompiler(tokenizer, Limits(compile_timeout_s=0.1), grammar_worker=None)
    try:
        with pytest.raises(ScenarioError) as error:
            asyncio.run(compiler.prepare(_deep_tree(4_000)))
        assert error.value.kind == "timeout"
        _ended_stopped(compiler)
    finally:
        compiler.close()


@pytest.fixture(scope="module")
def manager(start_manager):
    """The real config manager with a small compile_timeout_s."""
    with start_manager("compile-stop", limits=Limits(compile_timeout_s=LIMIT_S)) as manager:
        yield manager


def test_timed_out_admin_writes_do_not_lock_the_admin_api_out(manager):
    """Three writes past the limit in a row (more than the manager's two compile threads), then a small one: it
    compiles, because the three stopped. Before, the first two still held both threads and the small write timed
    out behind them (the report: every admin write a 400 for minutes)."""
    for _attempt in range(3):
        with pytest.raises(ServiceError) as error:
            manager.run(manager.put("many", MANY_LABELS))
        assert error.value.status == 400 and "compile_timeout_s" in error.value.message, error.value.message
    assert not manager.store.versions("many")  # nothing stored
    assert manager.run(manager.put("small", SMALL))["version"] == 1
    _ended_stopped(manager.compiler.pipeline)

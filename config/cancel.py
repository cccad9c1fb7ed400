"""Stopping a compile that ran past its time limit (here in ``config``, torch-free, because the tree loader is
here too).

A compile of a tree, a label set or a catalog runs on a worker thread (:meth:`processors.pipeline.ScenarioCompiler.
run_bounded`). A Python thread cannot be killed, so the caller's timeout alone would leave it running: it would
keep a core busy, hold memory and, where compiles are serialized (the config manager), make every later compile
wait behind it. Instead, the thread runs inside a :func:`stop_scope` whose event the caller sets when it gives up,
and the long loops of the table builders call :func:`checkpoint`, which raises :class:`CompileStopped` once the
event is set. A stopped compile ends within one loop step (a block of keys, a level of a trie, a label) of its
timeout, and leaves nothing behind: the builders only return what they finished.

Grammars compile in a child process that is killed instead (:mod:`processors.compile_worker`); the tokenizer's own
batch calls (Rust) are not interrupted, and their size is bounded up front by the limits.

Outside a scope (offline tools, tests calling the builders directly), :func:`checkpoint` does nothing.
"""

from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["CompileStopped", "checkpoint", "stop_scope", "run_stoppable"]

_stop: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("compile_stop", default=None)


class CompileStopped(Exception):
    """The compile's caller gave up on it (its time limit passed); the compile unwound at a checkpoint."""


def checkpoint() -> None:
    """Raise :class:`CompileStopped` when the current compile was asked to stop; cheap enough for every loop step."""
    event = _stop.get()
    if event is not None and event.is_set():
        raise CompileStopped("the compile was stopped at its time limit")


@contextmanager
def stop_scope(event: threading.Event) -> Iterator[threading.Event]:
    """Run the body with ``event`` as its stop signal (for :func:`checkpoint`)."""
    token = _stop.set(event)
    try:
        yield event
    finally:
        _stop.reset(token)


def run_stoppable(event: threading.Event, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inside :func:`stop_scope` (``event``): the callable a worker thread is given."""
    with stop_scope(event):
        return fn(*args)

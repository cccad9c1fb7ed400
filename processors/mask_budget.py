"""A per-step budget for the rows' grammar mask work, computed off the decode thread.

An llguidance mask is usually tens of microseconds (JSON schemas: at most about 11 ms of CPU time for a 200 KB enum
on this project's CPU), but an ambiguous grammar (``start: x+ "☃"`` with ``x: "a" | "ab" | ... | x x | x x x``)
costs more at every token: a second and more per mask after about 40 tokens, without ever reaching llguidance's
own limits (``step_max_items`` and the lexer fuel count other work than what grows there). Computed on the
engine's decode thread, such a mask holds every row of the replica.

:class:`MaskBudget` computes the masks a step needs (each row whose cursor has one due, :func:`mask_due`) in
parallel on a pool of threads (llguidance releases the GIL while it fills a mask) and waits for them. A row's
mask that has used ``budget_ms`` of CPU time (its worker thread's clock: a machine busy with other work does
not count against the row), or has not finished ``WALL_FACTOR x budget_ms`` after it started (its thread
starved), is *late*: its cursor is expired (:func:`expire`: it allows only its end token and never touches its
matcher again, which the worker may still be using) and :meth:`MaskBudget.settle` reports it, with a message
naming the setting, so the engine ends that row with ``finish_reason: "error"``.

The engine starts its one-row rows' masks (:meth:`MaskBudget.start`) before each forward, so a mask cheaper than
a forward is ready when the step needs it. The other rows never wait on a slower mask: a row named in ``defer`` whose mask is not done ``wait_ms`` after the
call (a short wait: most masks take microseconds) sits out the step, its mask computing on; a later call finds it
done (the row goes on) or late. The engine defers its one-row rows (see ``DecodeEngine``); rows it cannot leave out
of a step (a beam's, an ``n`` request's) are waited for, up to the budget.

Cursors take part through two optional members: ``mask_due`` (a property: the next :meth:`step` would compute
a mask) and ``prime()`` (compute it now and keep it); :class:`processors.RowCursor` and
:class:`processors.grammar.GrammarCursor` have them, every other cursor is left alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Iterable, Sequence

__all__ = ["SETTING", "STEP_WAIT_MS", "WALL_FACTOR", "MaskBudget", "expire", "late_message", "mask_due"]

#: the setting that gives the budget (``config.ServerSettings``)
SETTING = "mask_step_budget_ms"
#: a mask not finished this many budgets after it started is late whatever CPU time it used (a starved thread)
WALL_FACTOR = 10
#: how long a step waits for the masks of rows it may leave out before it goes on without them, ms (at most a
#: twentieth of the budget)
STEP_WAIT_MS = 10.0


def mask_due(cursor) -> bool:
    """Whether the cursor's next ``step()`` computes a mask (work the budget bounds)."""
    return bool(getattr(cursor, "mask_due", False))


def expire(cursor, message: str) -> None:
    """End a cursor whose mask work is late: it allows only its end token from now on and reports ``message``."""
    fn = getattr(cursor, "expire", None)
    if fn is not None:
        fn(message)


def late_message(budget_ms: float, cpu_ms: float, wall_ms: float) -> str:
    """The error of a row whose mask was late (it names the setting)."""
    return (f"grammar too costly: one step's token mask took over {budget_ms:g} ms ({SETTING}; {cpu_ms:.0f} ms of "
            f"CPU time, {wall_ms:.0f} ms in all, unfinished); an ambiguous grammar costs more at every token")


class _Task:
    """One row's mask computation on a worker thread: when it started, on which thread, that thread's CPU clock then."""

    __slots__ = ("cursor", "started", "thread", "cpu0", "future")

    def __init__(self, cursor) -> None:
        self.cursor = cursor
        self.started: float | None = None  # perf_counter when the worker started it
        self.thread: int | None = None
        self.cpu0 = 0.0
        self.future: Future | None = None

    def run(self) -> None:
        self.cpu0 = time.thread_time()
        self.thread = threading.get_ident()
        self.started = time.perf_counter()
        self.cursor.prime()

    def cpu_seconds(self) -> float:
        """CPU time its worker thread used on it so far (0 before it started, or where threads have no clock)."""
        if self.thread is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.thread)) - self.cpu0
        except (AttributeError, OSError, OverflowError):  # no per-thread clocks here (not Linux): the wall bound only
            return 0.0


class MaskBudget:
    """Grammar masks of a decode step computed in parallel, each within ``budget_ms`` (see the module docstring).

    Args:
        budget_ms: the CPU time one row's mask may take in one step; ``0``: no budget, masks are computed by the
            caller's ``step()`` on its own thread (the behaviour before the budget).
        max_workers: most threads (a late mask keeps its thread until it finishes; new ones are started meanwhile).
    """

    def __init__(self, budget_ms: float = 200.0, *, max_workers: int = 64):
        if budget_ms < 0:
            raise ValueError(f"{SETTING} must be >= 0, got {budget_ms}")
        self.budget_ms = float(budget_ms)
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max(1, max_workers)
        #: rows ended late so far, and masks computed
        self.stats = {"late_rows": 0, "masks": 0, "deferred": 0}
        #: masks being computed, by ``id(cursor)`` (the task holds the cursor: the id stays its own)
        self._running: dict[int, _Task] = {}

    @property
    def enabled(self) -> bool:
        return self.budget_ms > 0

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="grammar-mask")
        return self._pool

    def start(self, cursors: Iterable) -> None:
        """Start computing the due masks of ``cursors`` now, without waiting (the engine starts its one-row rows'
        masks before its forward, so they compute while the model runs); a later :meth:`settle` finds them."""
        if not self.enabled:
            return
        for cursor in cursors:
            self._submit(cursor)

    def _submit(self, cursor) -> _Task | None:
        """The computation of ``cursor``'s mask: the one running, or a new one if its mask is due."""
        task = self._running.get(id(cursor))
        if task is None and mask_due(cursor):
            task = _Task(cursor)
            task.future = self._executor().submit(task.run)
            self._running[id(cursor)] = task
            self.stats["masks"] += 1
        return task

    def settle(self, cursors: Sequence, skip: Iterable[int] = (), *, defer: Iterable[int] = (),
               wait_ms: float = 0.0) -> tuple[dict[int, str], set[int]]:
        """Compute the due masks of ``cursors`` (indices in ``skip`` left alone) within the budget.

        Returns ``(late, pending)``: ``{index: message}`` for the late ones, already expired, and the indices in
        ``defer`` whose mask is still being computed ``wait_ms`` after this call began (the caller leaves those rows
        out of this step; their masks go on computing and a later call finds them done, or late). A cursor not in
        ``defer`` is waited for until its mask is done or late. A cursor whose ``prime()`` raised is left as it is:
        its own ``step()`` raises again on the caller's thread, where the caller handles it."""
        if not self.enabled:
            return {}, set()
        skipped, deferrable = set(skip), set(defer)
        tasks: dict[int, _Task] = {}
        for i, cursor in enumerate(cursors):
            if i not in skipped:
                task = self._submit(cursor)
                if task is not None:
                    tasks[i] = task
        if not tasks:
            return {}, set()
        budget = self.budget_ms / 1000.0
        late: dict[int, str] = {}
        pending = dict(tasks)
        called = time.perf_counter()
        deadline = called + max(wait_ms, 0.0) / 1000.0
        while True:
            now = time.perf_counter()
            for i, task in list(pending.items()):
                assert task.future is not None
                if task.future.done():
                    del pending[i]
                    self._running.pop(id(task.cursor), None)
                    continue
                cpu = task.cpu_seconds()
                wall = now - (task.started if task.started is not None else called)
                if cpu >= budget or wall >= WALL_FACTOR * budget:
                    del pending[i]
                    self._running.pop(id(task.cursor), None)
                    late[i] = late_message(self.budget_ms, cpu * 1000, wall * 1000)
                    expire(task.cursor, late[i])
            if not pending or (now >= deadline and set(pending) <= deferrable):
                break
            futures = [t.future for t in pending.values() if t.future is not None]
            # wake up at least every tenth of the budget to read the workers' CPU clocks, and at the deadline
            timeout = budget / 10 if now >= deadline else min(budget / 10, deadline - now)
            wait(futures, timeout=max(timeout, 0.001), return_when=FIRST_COMPLETED)
        self.stats["late_rows"] += len(late)
        self.stats["deferred"] += len(pending)
        self._forget_done()
        return late, set(pending)

    def _forget_done(self) -> None:
        """Drop finished computations whose rows left (a row cancelled while its mask was computing)."""
        if len(self._running) > self._max_workers:
            for key, task in list(self._running.items()):
                if task.future is not None and task.future.done():
                    del self._running[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._running.clear()

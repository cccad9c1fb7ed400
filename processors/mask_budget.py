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
naming the setting, so the engine ends that row with ``finish_reason: "error"``. The step goes on for the other
rows: they wait at most the budget, once, for a late row.

Cursors take part through two optional members: ``mask_due`` (a property: the next :meth:`step` would compute
a mask) and ``prime()`` (compute it now and keep it); :class:`processors.RowCursor` and
:class:`processors.grammar.GrammarCursor` have them, every other cursor is left alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Iterable, Sequence

__all__ = ["SETTING", "WALL_FACTOR", "MaskBudget", "expire", "late_message", "mask_due"]

#: the setting that gives the budget (``config.ServerSettings``)
SETTING = "mask_step_budget_ms"
#: a mask not finished this many budgets after it started is late whatever CPU time it used (a starved thread)
WALL_FACTOR = 10


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
        self.stats = {"late_rows": 0, "masks": 0}

    @property
    def enabled(self) -> bool:
        return self.budget_ms > 0

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="grammar-mask")
        return self._pool

    def settle(self, cursors: Sequence, skip: Iterable[int] = ()) -> dict[int, str]:
        """Compute the due masks of ``cursors`` (indices in ``skip`` left alone) within the budget; returns
        ``{index: message}`` for the late ones, already expired. A cursor whose ``prime()`` raised is left as it
        is: its own ``step()`` raises again on the caller's thread, where the caller handles it."""
        if not self.enabled:
            return {}
        skipped = set(skip)
        tasks: dict[int, _Task] = {}
        for i, cursor in enumerate(cursors):
            if i not in skipped and mask_due(cursor):
                tasks[i] = _Task(cursor)
        if not tasks:
            return {}
        pool = self._executor()
        for task in tasks.values():
            task.future = pool.submit(task.run)
        self.stats["masks"] += len(tasks)
        budget = self.budget_ms / 1000.0
        late: dict[int, str] = {}
        pending = {i: t for i, t in tasks.items()}
        submitted = time.perf_counter()
        while pending:
            futures = [t.future for t in pending.values() if t.future is not None]
            # wake up at least every tenth of the budget to read the workers' CPU clocks
            wait(futures, timeout=max(budget / 10, 0.001), return_when=FIRST_COMPLETED)
            now = time.perf_counter()
            for i, task in list(pending.items()):
                assert task.future is not None
                if task.future.done():
                    del pending[i]
                    continue
                cpu = task.cpu_seconds()
                wall = now - (task.started if task.started is not None else submitted)
                if (cpu >= budget or wall >= WALL_FACTOR * budget) and not task.future.done():
                    del pending[i]
                    late[i] = late_message(self.budget_ms, cpu * 1000, wall * 1000)
                    expire(task.cursor, late[i])
        self.stats["late_rows"] += len(late)
        return late

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

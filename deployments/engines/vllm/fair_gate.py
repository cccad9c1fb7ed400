"""Which requests' rows go into vLLM, and in what order: one client at a time.

vLLM's scheduler serves its waiting requests in arrival order. Given every request as it comes, one client's burst
(up to its ``max_inflight_rows_per_client`` at the ingress) fills vLLM's batch and its queue, and another client's
one-row request waits behind all of it. :class:`FairGate` keeps the queue on our side instead: at most ``capacity``
rows (vLLM's ``max_num_seqs``, the rows it decodes together) are in vLLM at once; when rows end, the waiting requests
are offered the room in turn, the client with the fewest rows in vLLM first (then the earliest request), each client's
own requests first come first served. A request of several rows (``n``) waits until its rows fit together (or vLLM
is empty), so it is never starved by one-row requests: the client whose turn it is keeps it.

Rows end only when their outputs do, so a client whose rows fill vLLM would keep another client's request waiting
for the rest of their outputs (seconds). ``reserve`` more rows are kept for clients with no row in vLLM: such a
client's request goes in at once while the gate is full (vLLM's ``max_num_seqs`` is ``capacity + reserve``), and the
busy clients never take those rows.

It runs on the engine's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import itertools

__all__ = ["FairGate"]


class _Waiter:
    __slots__ = ("client", "width", "seq", "future")

    def __init__(self, client: str | None, width: int, seq: int, future: asyncio.Future):
        self.client = client
        self.width = width
        self.seq = seq
        self.future = future


class FairGate:
    """At most ``capacity`` rows in vLLM, offered to waiting requests one client at a time (see the module docstring)."""

    def __init__(self, capacity: int, reserve: int = 0):
        if capacity < 1 or reserve < 0:
            raise ValueError(f"capacity must be >= 1 and reserve >= 0, got {capacity}, {reserve}")
        self.capacity = capacity
        self.reserve = reserve
        self.used = 0
        self.running: dict[str | None, int] = {}
        self.waiting: list[_Waiter] = []
        self._seq = itertools.count()
        #: requests that waited for room, and rows admitted
        self.stats = {"waited": 0, "rows": 0}

    def width(self, rows: int) -> int:
        """The room a request of ``rows`` rows takes (a request wider than the gate takes all of it)."""
        return max(1, min(rows, self.capacity))

    async def acquire(self, client: str | None, rows: int) -> int:
        """Wait until the request's rows may go into vLLM; returns the room taken (release it row by row). A
        cancelled wait takes nothing."""
        width = self.width(rows)
        idle = not self.running.get(client) and all(w.client != client for w in self.waiting)
        # a client with nothing in or waiting takes a reserved row at once when the others have filled the capacity
        into_reserve = idle and self.used >= self.capacity and self.used + width <= self.capacity + self.reserve
        if (not self.waiting and self._fits(width)) or into_reserve:
            self._take(client, width)
            return width
        waiter = _Waiter(client, width, next(self._seq), asyncio.get_running_loop().create_future())
        self.waiting.append(waiter)
        self.stats["waited"] += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in self.waiting:
                self.waiting.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():  # granted just before the cancel
                self.release(client, width)
            self._grant()
            raise
        return width

    def release(self, client: str | None, rows: int = 1) -> None:
        """``rows`` of ``client``'s rows left vLLM: offer their room to the waiting requests."""
        self.used = max(0, self.used - rows)
        left = self.running.get(client, 0) - rows
        if left > 0:
            self.running[client] = left
        else:
            self.running.pop(client, None)
        self._grant()

    def _fits(self, width: int, reserve: bool = False) -> bool:
        """Room for ``width`` rows: within the capacity (or vLLM empty), or, with ``reserve`` (a client with no row
        in vLLM), within the reserve above it."""
        if self.used + width <= self.capacity or self.used == 0:
            return True
        return reserve and self.used + width <= self.capacity + self.reserve

    def _take(self, client: str | None, width: int) -> None:
        self.used += width
        self.running[client] = self.running.get(client, 0) + width
        self.stats["rows"] += width

    def _next(self) -> _Waiter | None:
        """The waiting request whose turn it is: the head of the client with the fewest rows in vLLM (ties: the
        earliest request)."""
        heads: dict[str | None, _Waiter] = {}
        for waiter in self.waiting:
            heads.setdefault(waiter.client, waiter)
        if not heads:
            return None
        return min(heads.values(), key=lambda w: (self.running.get(w.client, 0), w.seq))

    def _grant(self) -> None:
        while True:
            waiter = self._next()
            if waiter is None or not self._fits(waiter.width, not self.running.get(waiter.client)):
                return
            self.waiting.remove(waiter)
            if waiter.future.done():  # cancelled meanwhile
                continue
            self._take(waiter.client, waiter.width)
            waiter.future.set_result(None)

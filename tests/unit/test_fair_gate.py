"""The vLLM engine's fair gate (``deployments.engines.vllm.fair_gate``), on a real asyncio loop: at most its
capacity of rows in vLLM, the waiting requests offered room one client at a time, wide requests never starved, and a
cancelled wait takes nothing."""

from __future__ import annotations

import asyncio

import pytest

from deployments.engines.vllm.fair_gate import FairGate


def test_one_clients_burst_does_not_queue_another_client_behind_it():
    async def run():
        gate = FairGate(4)
        order: list[str] = []

        async def request(client: str, name: str, rows: int = 1):
            await gate.acquire(client, rows)
            order.append(name)

        burst = [asyncio.ensure_future(request("a", f"a{i}")) for i in range(12)]
        await asyncio.sleep(0)
        assert order == ["a0", "a1", "a2", "a3"] and gate.used == 4 and len(gate.waiting) == 8
        probe = asyncio.ensure_future(request("b", "b0"))
        await asyncio.sleep(0)
        gate.release("a")  # the first row to leave vLLM: its room goes to the other client, not to a4
        await asyncio.sleep(0)
        assert order[-1] == "b0" and probe.done()
        gate.release("a")
        await asyncio.sleep(0)
        assert order[-1] == "a4"
        for _ in range(7):
            gate.release("a")
        await asyncio.gather(*burst)
        assert order[4:] == ["b0"] + [f"a{i}" for i in range(4, 12)]  # a client's own requests first come first served
        assert gate.used == 4 and gate.running == {"a": 3, "b": 1}
        assert gate.stats["waited"] == 9

    asyncio.run(run())


def test_a_wide_request_waits_for_room_and_is_not_starved_by_one_row_requests():
    async def run():
        gate = FairGate(4)
        for _ in range(3):
            await gate.acquire("a", 1)
        wide = asyncio.ensure_future(gate.acquire("b", 3))
        await asyncio.sleep(0)
        assert not wide.done()
        late = asyncio.ensure_future(gate.acquire("c", 1))  # fits now, but the wide request's turn comes first
        await asyncio.sleep(0)
        assert not late.done()
        gate.release("a")
        gate.release("a")
        await asyncio.sleep(0)
        assert wide.done() and wide.result() == 3 and not late.done()
        gate.release("a")
        await asyncio.sleep(0)
        assert late.done() and gate.used == 4
        assert gate.width(99) == 4  # a request wider than the gate takes all of it, and goes in when vLLM is empty
        for _ in range(3):
            gate.release("b")
        gate.release("c")
        assert gate.used == 0 and await gate.acquire("d", 99) == 4

    asyncio.run(run())


def test_a_cancelled_wait_takes_no_room():
    async def run():
        gate = FairGate(1)
        await gate.acquire("a", 1)
        waiting = asyncio.ensure_future(gate.acquire("b", 1))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.waiting == []
        gate.release("a")
        assert gate.used == 0 and gate.running == {}
        # granted, then cancelled before it ran: the room goes back
        await gate.acquire("a", 1)
        granted = asyncio.ensure_future(gate.acquire("b", 1))
        await asyncio.sleep(0)
        gate.release("a")
        granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert gate.used == 0 and gate.running == {}

    asyncio.run(run())


def test_capacity_is_checked():
    with pytest.raises(ValueError):
        FairGate(0)


def test_a_client_with_no_row_in_goes_into_the_reserve_at_once():
    async def run():
        gate = FairGate(4, reserve=1)
        for _ in range(4):
            await gate.acquire("burst", 1)
        queued = [asyncio.ensure_future(gate.acquire("burst", 1)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(q.done() for q in queued)
        await asyncio.wait_for(gate.acquire("probe", 1), 1)  # full for the burst, not for a client with none in
        assert gate.used == 5 and gate.running == {"burst": 4, "probe": 1}
        second = asyncio.ensure_future(gate.acquire("probe", 1))  # the probe is in now: it waits like anyone
        late = asyncio.ensure_future(gate.acquire("other", 2))  # two rows do not fit the reserve left (none)
        await asyncio.sleep(0)
        assert not second.done() and not late.done()
        gate.release("probe")  # the probe has no row in again: its next request takes the reserved row
        await asyncio.sleep(0)
        assert second.done() and not late.done() and not any(q.done() for q in queued)
        gate.release("burst")  # under the capacity again: the fairest waiting request's turn (two rows: no room)
        await asyncio.sleep(0)
        assert not late.done() and not any(q.done() for q in queued)
        gate.release("probe")
        await asyncio.sleep(0)
        assert late.done() and not any(q.done() for q in queued)  # its turn kept: the burst's queue waits
        for q in queued + [late]:
            q.cancel()
        await asyncio.gather(*queued, late, return_exceptions=True)

    asyncio.run(run())

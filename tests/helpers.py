"""Small helpers shared by every test tier (unit, integration, serve, security, faults and the vLLM tier): a free
port, a chat body, the prompt ids of a chat, polling until a condition holds, the ``openai`` client on a running
app, how much a call grew this process's memory, a long string column that costs little memory, the HTTP answer
a raw-socket client reads. Imported as ``helpers``: pytest puts ``tests/`` on ``sys.path`` for ``tests/conftest.py``
(no ``__init__.py``); a script started in its own process (``tests/faults/two_nodes.py``) puts it there itself.

Nothing here imports the project or a heavy library at import time.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["chat_prompt_ids", "free_port", "http_answer", "openai_client", "repeated_strings", "resident_growth",
           "user_messages", "wait_until", "wait_until_async"]


_RAY_WORKER_PORTS_END = 20000  # Ray's worker ports are 10002-19999 by default


def free_port() -> int:
    """A TCP port free on the loopback address now, between Ray's worker ports and the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` is an ephemeral one, and the processes a test starts next (Ray's
    GCS, raylets, dashboard, workers) take ephemeral ports too: one of them took such a port before Serve's proxy
    bound it (``Address already in use``, tests/faults/two_nodes.py, 2026-12-01). A port below that range is handed
    to no one else."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral_low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    if ephemeral_low - _RAY_WORKER_PORTS_END >= 1000:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.randrange(_RAY_WORKER_PORTS_END, ephemeral_low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # (no such range here: any free port)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """The status line and headers, and the body (by its Content-Length), of the HTTP answer read from ``sock`` (a
    raw-socket client's: what came before the connection closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            return data, b""
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (piece := sock.recv(65536)):
        body += piece
    return head, body


def user_messages(text: str) -> list[dict]:
    """The ``messages`` of a chat body with one user message, ``text``."""
    return [{"role": "user", "content": text}]


def chat_prompt_ids(tokenizer: Any, text: str, compiled: Any = None) -> list[int]:
    """The prompt ids of a chat of one user message, ``text``, as the service builds them for ``compiled`` (a compiled
    scenario, or ``None`` for free text)."""
    from processors import build_prompt_ids

    return build_prompt_ids(compiled, tokenizer, messages=user_messages(text))


def wait_until(fn: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.5,
               errors: tuple[type[BaseException], ...] = ()) -> Any:
    """Call ``fn`` every ``interval`` seconds until it returns something truthy, and return that. An exception of
    one of ``errors`` counts as a falsy answer (it is kept as the last value). After ``timeout`` seconds: an
    ``AssertionError`` naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except errors as exc:
            last = exc
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}")


def resident_growth(call: Callable[[], Any]) -> tuple[Any, int]:
    """``(call(), bytes)``: what ``call`` returned and the most this process's resident memory grew above what it
    held at the start while it ran (sampled every 2 ms from a thread). An exception of ``call`` propagates."""
    import threading

    import psutil

    process = psutil.Process()
    start = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = call()
    finally:
        done.set()
        sampler.join()
        peak = max(peak, process.memory_info().rss)
    return result, peak - start


def repeated_strings(rows: int, value: str, odd: tuple[int, str] | None = None) -> Any:
    """A pyarrow string column of ``rows`` rows of ``value``, made of one shared 10,000-row chunk (not ``rows``
    copies in memory: a Parquet writer dictionary-encodes it into a small file); ``odd``: ``(row, another value)``."""
    import pyarrow as pa

    block = pa.array([value] * min(rows, 10_000))
    column = pa.chunked_array([block] * (rows // len(block)) + [block.slice(0, rows % len(block))])
    if odd is not None:
        row, other = odd
        assert 0 <= row < rows, (row, rows)
        column = pa.chunked_array([*column.slice(0, row).chunks, pa.array([other]), *column.slice(row + 1).chunks])
    return column


async def wait_until_async(predicate: Callable[[], Any], *, timeout: float, what: str,
                           interval: float = 0.02) -> Any:
    """:func:`wait_until` on an event loop: ``predicate`` may return a coroutine (awaited), and the waits are
    ``asyncio.sleep``, so the loop's other tasks run meanwhile."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}")


def openai_client(url: str, timeout: float) -> Any:
    """The official ``openai`` client on the app at ``url`` (its ``/v1``), without retries: a failed request fails
    the test instead of being sent again."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def assert_answers_as(over, ref):
    """Tables ``over`` (an overlay version of a catalog's tables, ``processors/kinds/tree/tables/overlay.py``) answer as
    ``ref`` (plain tables of the same items): both walked from the root in step, the same edges (tokens, kinds of
    target) and item metrics everywhere, the batched edge search as the scalar one, the same items read back."""
    import numpy as np

    from processors.kinds.tree.tables.delta import max_remaining
    from processors.kinds.tree.tables.items import tree_items
    from processors.tables import DONE, LEAF, _item_metrics, item_metrics

    o_min, o_items, o_uniform, o_deep = item_metrics(over)
    r_min, r_items, r_uniform, r_deep = _item_metrics(ref)
    o_max, r_max = max_remaining(over), max_remaining(ref)
    assert (o_uniform, o_deep) == (r_uniform, r_deep)
    assert (over.root < 0) == (ref.root < 0)
    pending = [(over.root, ref.root)] if ref.root >= 0 else []
    seen = 0
    while pending:
        so, sr = pending.pop()
        seen += 1
        np.testing.assert_array_equal(over.allowed(so), ref.allowed(sr))
        assert (o_min[so], o_items[so], o_max[so]) == (r_min[sr], r_items[sr], r_max[sr])
        lo_o, lo_r = int(over.offsets[so]), int(ref.offsets[sr])
        for k in range(int(ref.offsets[sr + 1]) - lo_r):
            to, tr = int(over.next_state[lo_o + k]), int(ref.next_state[lo_r + k])
            if tr >= 0:
                assert to >= 0
                pending.append((to, tr))
            else:
                assert to == tr and tr in (LEAF, DONE)
    assert seen == ref.n_states
    # the batched search agrees with the scalar one on reachable and superseded states alike
    rnd = np.random.default_rng(0)
    states = rnd.integers(-1, over.n_states + 1, 300)
    toks = rnd.integers(0, over.vocab_size, 300)
    got = over.find_edges(states, toks)
    want = [over.edge(int(s), int(t)) for s, t in zip(states, toks)]
    np.testing.assert_array_equal(got, want)
    # the items a walk from the root reads (what an inline tree's PATCH reads) are the same
    fo, lo = tree_items(over)
    fr, lr = tree_items(ref)
    as_set = lambda flat, lens: {tuple(x) for x in np.split(flat, np.cumsum(lens)[:-1]).__iter__()}  # noqa: E731
    assert as_set(fo, lo) == as_set(fr, lr)

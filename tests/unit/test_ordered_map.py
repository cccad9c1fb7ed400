"""processors.kinds.tree.treefile.scan.ordered_map: the threaded map that reads a large tree's blocks on two cores."""

from __future__ import annotations

import os
import threading
import time

import pytest

from processors.kinds.tree.treefile.scan import ordered_map


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_results_come_in_order(threads):
    def slow_square(x):
        time.sleep(0.002 * ((7 * x) % 5))  # later items often finish first
        return x * x

    assert list(ordered_map(slow_square, range(40), threads)) == [x * x for x in range(40)]


def test_an_exception_is_raised_where_its_result_is_taken():
    def fail_at_3(x):
        if x == 3:
            raise KeyError(x)
        return x

    taken = []
    with pytest.raises(KeyError):
        for value in ordered_map(fail_at_3, range(10), 2):
            taken.append(value)
    assert taken == [0, 1, 2]


def test_a_taker_that_stops_early_leaves_the_rest_unstarted():
    started = []

    def record(x):
        started.append(x)
        time.sleep(0.01)
        return x

    for value in ordered_map(record, range(100), 2):
        if value == 1:
            break
    assert len(started) <= 6  # the two taken plus at most two per thread in flight


def test_workers_run_at_the_priority_of_the_thread_that_starts_them():
    """The config manager lowers its compile threads' priority; a scan started there must not run above it."""
    seen = []

    def niced_caller():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 3)
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        workers = list(ordered_map(lambda _: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), range(8), 2))
        seen.append((mine, workers))

    thread = threading.Thread(target=niced_caller)
    thread.start()
    thread.join()
    mine, workers = seen[0]
    assert workers == [mine] * 8

"""Compiled tables shared per node: the memory of 1 and 2 readers of one tree's tables through Ray's object store.

A synthetic tree of ``--keys`` keys (as bench/compile.py makes them) is compiled in this process and ``ray.put``
once, as the config manager does (``deployments/manager/served.py:object_ref``). Then, for 1 and for 2 reader
actors on this node, each actor fetches it the way a model replica does (``deployments/replica/subscriber.py:_fetch``: it
awaits the reference) and reads every byte of every array (as decoding over the whole catalog eventually would),
and reports its resident (RSS), proportional (PSS) and unique (USS) memory from ``/proc/self/smaps_rollup``,
before the fetch and after the read. For comparison in the same run, one actor makes a private copy of the arrays
(what a replica would hold if the tables were unpickled into its heap).

The tables are shared when USS grows by next to nothing per reader and the PSS of 2 readers adds up to about one
copy; a private copy shows as USS equal to the tables' size.

    python bench/table_sharing.py [--keys 10000000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, iter_tree, log, write_tree_json  # noqa: E402

VOCAB = 49_152
MIB = 1 << 20


def smaps() -> dict[str, float]:
    out = {}
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {"rss_mib": round(out.get("Rss", 0), 1), "pss_mib": round(out.get("Pss", 0), 1),
            "uss_mib": round(out.get("Private_Clean", 0) + out.get("Private_Dirty", 0), 1)}


def _arrays(tables):
    import numpy as np

    out = [tables.offsets, tables.tokens, tables.next_state]
    metrics = tables.__dict__.get("_item_metrics")
    if metrics is not None:
        out += [m for m in metrics if isinstance(m, np.ndarray)]
    return out


def make_reader():
    import ray

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self):
            import deployments.replica  # noqa: F401 - what a replica has imported before its tables arrive

            self.tables = None
            self.before = smaps()

        async def fetch(self, refs, copy: bool = False):
            from deployments.replica.subscriber import _fetch

            t0 = time.perf_counter()
            tables = await _fetch(refs[0])  # the replica's own fetch: awaits the reference
            fetch_s = time.perf_counter() - t0
            if copy:  # the control: arrays unpickled into this process's heap
                import copy as copy_module

                tables = copy_module.deepcopy(tables)
            checksum = 0
            for arr in _arrays(tables):  # read every byte
                checksum += int(arr.view("uint8").sum(dtype="uint64"))
            self.tables = tables
            writable = [bool(a.flags.writeable) for a in _arrays(tables)]
            return {"fetch_s": round(fetch_s, 4), "checksum": checksum, "before": self.before, "after": smaps(),
                    "any_array_writable": any(writable), "pid": os.getpid()}

        def memory(self):
            return smaps()

    return Reader


async def _readers(ref, count: int, copy: bool) -> list[dict]:
    Reader = make_reader()
    actors = [Reader.remote() for _ in range(count)]
    results = await asyncio.gather(*[a.fetch.remote([ref], copy) for a in actors])
    # every reader reads again once all are done, so that PSS splits the pages among all of them
    final = await asyncio.gather(*[a.memory.remote() for a in actors])
    for r, m in zip(results, final):
        r["final"] = m
        r["added"] = {k: round(m[k] - r["before"][k], 1) for k in m}
    import ray

    for a in actors:
        ray.kill(a)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import ray

    from processors.kinds.tree.treefile.load import load_tree
    import processors

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tree.json")
        write_tree_json(path, iter_tree(args.keys, VOCAB, start_token_id=1, end_token_id=2, seed=args.seed),
                        start_token_id=1, end_token_id=2)
        t0 = time.perf_counter()
        tables = processors.build_tree_tables(load_tree(path, vocab_size=VOCAB), VOCAB)
        compile_s = time.perf_counter() - t0
    table_mib = sum(a.nbytes for a in _arrays(tables)) / MIB
    log(f"{args.keys} keys compiled in {compile_s:.1f} s: {tables.n_states} states, {tables.n_edges} edges, "
        f"{table_mib:.0f} MiB of arrays")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=max(int(table_mib * MIB * 3), 512 * MIB))
    try:
        ref = ray.put(tables)
        version = tables.version
        del tables
        runs = {}
        for label, count, copy in (("1 reader", 1, False), ("2 readers", 2, False), ("1 reader, private copy", 1, True)):
            res = asyncio.run(_readers(ref, count, copy))
            runs[label] = res
            for r in res:
                log(f"{label}: pid {r['pid']} fetch {r['fetch_s']:.3f} s; added RSS {r['added']['rss_mib']:.0f} MiB, "
                    f"PSS {r['added']['pss_mib']:.0f} MiB, USS {r['added']['uss_mib']:.0f} MiB")
        checks = {r["checksum"] for res in runs.values() for r in res}
    finally:
        ray.shutdown()

    def total(label, key):
        return round(sum(r["added"][key] for r in runs[label]), 1)

    emit({
        "benchmark": "table_sharing",
        "keys": args.keys,
        "tables_version": version,
        "table_arrays_mib": round(table_mib, 1),
        "compile_s": round(compile_s, 1),
        "same_bytes_read_by_every_reader": len(checks) == 1,
        "readers": runs,
        "added_per_node_mib": {label: {k: total(label, k) for k in ("rss_mib", "pss_mib", "uss_mib")} for label in runs},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - t_start, 1),
    })


if __name__ == "__main__":
    main()

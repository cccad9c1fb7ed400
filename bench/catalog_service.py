"""A catalog at scale through the service: PUT of a Parquet catalog, PATCHes of 2,000 items, a 256-beam request, and
the whole service's memory, 2 model replicas (the service's side of ``bench/catalog_scale.py``'s sizes).

For each ``--items`` size a Parquet file of random distinct 4-token semantic ids (``list<int32>``, 256 codes per
level, each level its own token range; the header in the file's metadata) is written once and uploaded by
``PUT /admin/scenarios/{name}`` (``application/vnd.apache.parquet``), timed until both replicas serve it; then
``--rounds`` PATCHes of ``--delta`` items (half new 4-token ids, half present ones), each timed until both replicas
serve it; then one request with ``num_beams`` = ``n`` = ``--beams`` whose every output must be an item of the
version it reports. A thread samples the resident memory of every process of the service (Ray's processes, the model
replicas, the manager, the embedded Redis) every 0.5 s: ``peak_service_rss_gb`` is the largest sum, with each
process's own peak beside it; ``peak_service_pss_gb`` the largest sum of their proportional set sizes, where a page
shared by several processes (Redis's forks while it saves, the tables both replicas map) is counted once in all. The comparison in the run is the PUT against the PATCH of the same catalog
(``put_over_patch_p50``); the compile alone at these sizes is ``bench/catalog_scale.py``'s.

    .venv/bin/python bench/catalog_service.py [--items 10000000] [--rounds 5] [--beams 256] [--by-path] [--restart]

The service runs with ``max_upload_bytes`` 8 GiB (the upload is streamed to the manager in 16 MiB parts and spooled
to a file there), ``max_tree_keys`` 2 * 10^8, ``write_memory_mb`` ``--write-memory-mb``
and ``compile_timeout_s`` 1,800 (the defaults refuse such a catalog by design). ``--by-path``: the PUT names the
Parquet file, written into the service's tree directory, instead of uploading it (``{"type": "tree", "path": ...}``:
the manager reads the file). ``--restart``: after the PATCHes, the manager's process is killed; ``restart`` reports the
seconds until a new one serves the version again and the first PATCH after it (the same delta). One JSON object
last; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, pss_bytes, ratio  # noqa: E402
from bench._serve import ServeBench, in_sync, percentile  # noqa: E402
from bench.catalog_scale import DEPTH, _distinct, make_ids  # noqa: E402

REPLICAS = 2
VOCAB = 49_152


class MemorySampler(threading.Thread):
    """The summed RSS of the service's processes (every process but this one and its parents), every ``period`` s;
    and their summed PSS (``peak_pss``), which counts a page shared by several processes once in all."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.period = psutil, period
        me = psutil.Process()
        self.skip = {me.pid, *(p.pid for p in me.parents())}
        self.peak_sum, self.peak_by, self.peak_pss = 0, {}, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total = pss = 0
            for proc in self.psutil.process_iter(["pid", "name", "cmdline", "memory_info"]):
                info = proc.info
                if info["pid"] in self.skip or info["memory_info"] is None:
                    continue
                cmd = " ".join(info["cmdline"] or [])[:80]
                if not any(k in cmd or k in (info["name"] or "") for k in ("ray", "redis", "raylet", "gcs_server")):
                    continue
                rss = int(info["memory_info"].rss)
                total += rss
                pss += pss_bytes(info["pid"])
                # a Ray worker retitles itself per call ("ray::...:ConfigManager.handle_request..."): one key per pid
                label = (cmd.split()[0] if cmd.strip() else info["name"] or "?").split(".handle_")[0]
                key = f"{label.removeprefix('ray::ServeReplica:constrained-bench:')} (pid {info['pid']})"
                old = next((k for k in self.peak_by if k.endswith(f"(pid {info['pid']})")), key)
                self.peak_by[old] = max(self.peak_by.get(old, 0), rss)
            self.peak_sum = max(self.peak_sum, total)
            self.peak_pss = max(self.peak_pss, pss)
            self.stop.wait(self.period)

    def top(self, k: int = 8) -> dict[str, float]:
        ranked = sorted(self.peak_by.items(), key=lambda kv: -kv[1])[:k]
        return {name: round(rss / 2**30, 2) for name, rss in ranked}


def write_parquet(ids: np.ndarray, path: Path, start: int, end: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.ListArray.from_arrays(pa.array(np.arange(0, ids.size + 1, DEPTH, dtype=np.int32)),
                                      pa.array(ids.reshape(-1)))
    table = pa.table({"ids": column}).replace_schema_metadata(
        {"catalog": json.dumps({"start_token_id": start, "end_token_id": end, "max_new_tokens": DEPTH + 1})})
    pq.write_table(table, path, row_group_size=1 << 20)


def _row_keys(ids: np.ndarray) -> np.ndarray:
    """Each row packed into one int64 (16 bits an id), sorted: an output is looked up by one search, not a scan of
    10^8 rows."""
    key = np.zeros(ids.shape[0], dtype=np.int64)
    for c in range(ids.shape[1]):
        key <<= 16
        key |= ids[:, c].astype(np.int64)
    key.sort()
    return key


def _row_in(keys: np.ndarray, item: tuple[int, ...]) -> bool:
    want = 0
    for t in item:
        want = (want << 16) | int(t)
    i = int(np.searchsorted(keys, want))
    return i < keys.size and int(keys[i]) == want


def served(bench: ServeBench, name: str, version: int, timeout: float = 1800) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = bench.health()
        versions = [v.get(name) for v in (r.get("versions") or {} for r in (health.get("replicas") or {}).values())]
        if len(versions) == REPLICAS and all(v == version for v in versions) and in_sync(health, REPLICAS):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{name} v{version} not served by {REPLICAS} replicas after {timeout} s")


def restart_then_patch(bench: ServeBench, name: str, version: int, remove: list[list[int]],
                       earlier: list[list[int]], rng: np.random.Generator) -> dict:
    """Kill the manager's process (SIGKILL), wait until a new one holds ``name`` at ``version`` and both replicas
    serve it, then time one PATCH removing ``remove`` and adding as many new ids (none of ``earlier``)."""
    import os
    import signal

    from bench._serve import serve_actors

    (manager,) = serve_actors("constrained-bench", "ConfigManager")
    t0 = time.perf_counter()
    os.kill(int(manager["Pid"]), signal.SIGKILL)
    deadline = time.time() + 3600
    while time.time() < deadline:
        now = serve_actors("constrained-bench", "ConfigManager")
        try:
            scenarios = (bench.health().get("manager") or {}).get("scenarios") or {}
        except Exception:  # noqa: BLE001 - the app answers again once the new manager is up
            scenarios = {}
        if len(now) == 1 and now[0]["Pid"] != manager["Pid"] and scenarios.get(name) == version:
            break
        time.sleep(0.2)
    served(bench, name, version)
    back_s = time.perf_counter() - t0
    log(f"  manager restarted: {back_s:.1f} s until it serves version {version}")
    ids = rng.integers(0, 256, size=(len(remove), DEPTH)) + 1000 + np.arange(DEPTH) * 256
    ids[:, 0] = 1000 + 256 * DEPTH + 65  # (a first token no earlier PATCH used)
    add = [list(a) for a in {tuple(a) for a in ids.tolist()} if list(a) not in earlier]
    t0 = time.perf_counter()
    r = bench.session.patch(f"{bench.url}/admin/scenarios/{name}", json={"add": add, "remove": remove},
                            headers=bench.admin, timeout=3600)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:1000]
    answer = r.json()
    assert answer["removed"] == len(remove), answer
    log(f"  first PATCH after the restart: {took:.3f} s (version {answer['version']})")
    served(bench, name, answer["version"])
    return {"until_served_s": round(back_s, 1), "first_patch_s": round(took, 3), "version": answer["version"],
            "added": add}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="10000000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--delta", type=int, default=2000)
    ap.add_argument("--beams", type=int, default=256)
    ap.add_argument("--write-memory-mb", type=int, default=20_000)
    ap.add_argument("--by-path", action="store_true",
                    help="PUT {\"type\": \"tree\", \"path\": ...}: the manager reads the Parquet file from its tree "
                         "directory (no upload)")
    ap.add_argument("--restart", action="store_true",
                    help="after the PATCHes: kill the manager's process, time until the new one serves the version, "
                         "then one more PATCH (the first after a restart)")
    args = ap.parse_args()

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    start, end = chat_root_token_id(tokenizer), int(tokenizer.eos_token_id)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ServeBench() as bench:
        bench.deploy(bench.settings(num_replicas=REPLICAS, torch_threads=1, seed_examples=False,
                                    write_memory_mb=args.write_memory_mb,
                                    limits={"max_upload_bytes": 8 << 30, "max_tree_keys": 200_000_000,
                                            "compile_timeout_s": 1800, "max_num_beams": max(args.beams, 8),
                                            "max_n": max(args.beams, 8)}),
                     replicas=REPLICAS)
        for n in [int(x) for x in args.items.split(",")]:
            ids = _distinct(make_ids(n, 256))
            ids = ids[np.random.default_rng(1).permutation(ids.shape[0])]  # (a row shuffle in place: minutes at 10^8)
            folder = Path(bench.data_dir) / "trees" if args.by_path else Path(tmp)  # (the tree directory's default)
            folder.mkdir(exist_ok=True)
            path = folder / f"catalog-{n}.parquet"
            write_parquet(ids, path, start, end)
            size = path.stat().st_size
            log(f"{ids.shape[0]:,} items, Parquet {size / 2**20:,.0f} MiB")
            name = f"scale-{n}"
            sampler = MemorySampler()
            sampler.start()
            t0 = time.perf_counter()
            if args.by_path:  # the manager reads the file (memory-mapped); the body is a few bytes
                r = bench.session.put(f"{bench.url}/admin/scenarios/{name}", timeout=3600, headers=bench.admin,
                                      json={"type": "tree", "path": path.name})
            else:
                with path.open("rb") as body:  # (sent from the file as it is read: streamed on by the ingress)
                    r = bench.session.put(f"{bench.url}/admin/scenarios/{name}", data=body, timeout=3600,
                                          headers={**bench.admin, "Content-Type": "application/vnd.apache.parquet"})
            put_s = time.perf_counter() - t0
            assert r.status_code == 200, r.text[:1000]
            version = r.json()["version"]
            log(f"  PUT {put_s:.1f} s (version {version}); service peak so far "
                f"{sampler.peak_sum / 2**30:.2f} GiB")
            picked = np.random.default_rng(2).choice(ids.shape[0], min(50_000, ids.shape[0] // 2), replace=False)
            present = {tuple(row) for row in ids[picked].tolist()}
            rng = np.random.default_rng(3)
            patch_s: list[float] = []
            refused: list[str] = []
            removed_all: set[tuple[int, ...]] = set()
            added_all: set[tuple[int, ...]] = set()
            for k in range(args.rounds):
                remove = [list(i) for i in list(present)[:args.delta - args.delta // 2]]
                present -= {tuple(i) for i in remove}
                add = (rng.integers(0, 256, size=(args.delta // 2, DEPTH)) + 1000 + np.arange(DEPTH) * 256)
                add[:, 0] = 1000 + 256 * DEPTH + 1 + rng.integers(0, 64, size=add.shape[0])  # a first token unused
                add_list = [list(map(int, a)) for a in {tuple(a) for a in add.tolist()}]
                t0 = time.perf_counter()
                r = bench.session.patch(f"{bench.url}/admin/scenarios/{name}", json={"add": add_list,
                                        "remove": remove}, headers=bench.admin, timeout=3600)
                took = time.perf_counter() - t0
                if r.status_code == 507:  # the manager's memory guard: recorded, the version stays as it was
                    refused.append(r.json()["error"]["message"])
                    log(f"  PATCH {k + 1}: refused 507 in {took:.3f} s: {refused[-1]}")
                    break
                assert r.status_code == 200, r.text[:1000]
                answer = r.json()
                assert answer["removed"] == len(remove), answer
                removed_all |= {tuple(i) for i in remove}
                added_all |= {tuple(i) for i in add_list}
                patch_s.append(took)
                version = answer["version"]
                log(f"  PATCH {k + 1}: {took:.3f} s (version {version})")
            served(bench, name, version)
            restart = None
            if args.restart:  # the manager killed: a new process reads the catalog back, then one PATCH is timed
                remove = [list(i) for i in list(present)[:args.delta - args.delta // 2]]
                present -= {tuple(i) for i in remove}
                restart = restart_then_patch(bench, name, version, remove, add_list, rng)
                removed_all |= {tuple(i) for i in remove}
                added_all |= {tuple(i) for i in restart.pop("added")}
                version = restart["version"]
            t0 = time.perf_counter()
            r = bench.session.post(f"{bench.url}/v1/generate", timeout=3600, json={
                "scenario": name, "prompt": "Recommend:", "num_beams": args.beams, "n": args.beams,
                "max_new_tokens": DEPTH + 1})
            beam_s = time.perf_counter() - t0
            assert r.status_code == 200, r.text[:1000]
            out = r.json()
            assert out["version"] == version, (out["version"], version)
            got = [tuple(o["token_ids"][:-1] if o["token_ids"][-1:] == [end] else o["token_ids"])
                   for o in out["outputs"]]
            keys = _row_keys(ids)
            for item in got:  # an item of the served version: not removed, an item uploaded or added
                assert len(item) == DEPTH and item not in removed_all, item
                assert item in added_all or _row_in(keys, item), item
            del keys
            sampler.stop.set()
            sampler.join()
            rows.append({"items": int(ids.shape[0]), "parquet_mb": round(size / 2**20, 1),
                         "put_form": "path" if args.by_path else "upload", "put_s": round(put_s, 1),
                         "patch_p50_s": round(percentile(patch_s, 50), 3) if patch_s else None,
                         "patch_p95_s": round(percentile(patch_s, 95), 3) if patch_s else None,
                         "patches_s": [round(x, 3) for x in patch_s], "patches_refused": refused,
                         "restart": restart,
                         "beam_request_s": round(beam_s, 2), "beams": args.beams, "outputs": len(got),
                         "distinct_outputs": len(set(got)),
                         "peak_service_rss_gb": round(sampler.peak_sum / 2**30, 2),
                         "peak_service_pss_gb": round(sampler.peak_pss / 2**30, 2),
                         "peak_rss_by_process_gb": sampler.top()})
            log(json.dumps(rows[-1]))
            r = bench.session.delete(f"{bench.url}/admin/scenarios/{name}", headers=bench.admin, timeout=600)
            del ids
    emit({"bench": "catalog_service", "replicas": REPLICAS, "delta": args.delta, "rows": rows,
          "put_over_patch_p50": [ratio(r["put_s"], r["patch_p50_s"] or 0) for r in rows]})


if __name__ == "__main__":
    main()

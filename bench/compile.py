"""Compile time and peak memory: tree files of 10^6 and 10^7 keys, and a 10^5-label set.

(a) Trees. For each size in ``--tree-keys``, a synthetic prefix dict (root with ~300 candidates, depth 4-8, ids
spread over a 49,152-id vocabulary) is written as a tree JSON file (docs/design.md format), then each phase runs
in a fresh subprocess:

* ``load``:  ``load_tree(path, vocab_size=V)`` (the numpy scan of the file + every validation rule);
* ``build``: ``processors.build_tree_tables(tree, V)`` on an already loaded tree (edges linked by key hashes, the
  per-state item metrics included);
* ``both``:  the two together, as the manager's compile runs them;
* ``exact``: the same result by the exact paths, for comparison in the same run: the ijson event parser and the
  build through a dict of key strings (what every tree took before the numpy paths; skipped past 2*10^6 keys);
* ``naive``: ``json.load`` into a Python dict of lists (no validation, no tables; skipped past 2*10^6 keys).

``both`` and ``exact`` alternate over ``--repeats`` rounds (the machine is shared: ratios from one run).

(b) Labels (``--labels``, 0 skips). Synthetic taxonomy labels ("Technology > AI > NLP") compiled with
``processors.build_label_tables`` for SmolLM2's tokenizer in a fresh subprocess; then, in the same process, the
tokenization it does (one ``encode`` + one ``decode`` per label, round trip checked) is timed against batched calls.

Peak memory: in each subprocess, the peak resident set size (``VmHWM``) is reset through ``/proc/self/clear_refs``
once the phase's imports and inputs are ready, and the result is the peak after the phase minus the resident size
before it (what the phase adds at its worst moment); ``peak_rss_mib`` is the process's whole peak (imports and
input included). CPU seconds of the phase are reported beside wall seconds (on a loaded machine the wall time
includes waiting for a core).

Targets: 10^6 keys in at most 2 s, 10^7 keys in at most 25 s with a peak under 4 GiB.

    python bench/compile.py [--quick] [--tree-keys 1000000,10000000] [--labels 100000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, iter_tree, log, make_labels, ratio, rss_bytes, run_json_subprocess, write_tree_json  # noqa: E402

VOCAB = 49_152  # SmolLM2's vocabulary
START, END = 1, 2  # <|im_start|> / <|endoftext|> in SmolLM2
TIME_TARGETS_S = {1_000_000: 2.0, 10_000_000: 25.0}
MEM_TARGET_BYTES = 4 << 30  # the peak of the process compiling 10^7 keys
EXACT_MAX_KEYS = 2_000_000
MIB = 1 << 20


# --------------------------------------------------------------------------- phase helpers (run in subprocesses)


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakMeter:
    """Peak RSS a block of code adds over the RSS it started with."""

    def __enter__(self):
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.method = "VmHWM reset via /proc/self/clear_refs, minus RSS at start of phase"
        except OSError:
            self.method = "peak RSS since process start (clear_refs refused), minus RSS at start of phase"
        self.start = rss_bytes()
        return self

    def __exit__(self, *exc):
        self.peak = _vm_hwm()
        self.extra = max(0, self.peak - self.start)
        return False


def phase_tree(kind: str, path: str, vocab: int) -> dict:
    out: dict = {"phase": kind}
    if kind == "naive":
        with PeakMeter() as pm:
            t0, c0 = time.perf_counter(), time.process_time()
            with open(path) as fh:
                data = json.load(fh)
            prefix = data["prefix_dict"]  # already a Python dict of lists
            out["seconds"], out["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        out["keys"] = len(prefix)
    else:
        from processors.kinds.tree.treefile.load import load_tree
        import processors
        from processors.kinds.tree.treefile import load as tree_file
        from processors.tables import _build_by_strings

        if kind == "exact":  # the ijson parser and the dict-of-strings build
            tree_file.scan_tree_file = lambda p: None
        tree = None
        if kind == "build":
            tree = load_tree(path, vocab_size=vocab)
        with PeakMeter() as pm:
            t0, c0 = time.perf_counter(), time.process_time()
            if tree is None:
                tree = load_tree(path, vocab_size=vocab)
            t1 = time.perf_counter()
            tables = None
            if kind == "exact":
                tables = _build_by_strings(tree, tree.offsets, tree.candidates, vocab)
            elif kind != "load":
                tables = processors.build_tree_tables(tree, vocab)
            t2, c2 = time.perf_counter(), time.process_time()
        out["seconds"], out["cpu_seconds"] = t2 - t0, c2 - c0
        if kind in ("both", "exact"):
            out["load_seconds"], out["build_seconds"] = t1 - t0, t2 - t1
        out["keys"] = len(tree)
        if tables is not None:
            out["states"], out["edges"], out["tables_mib"] = tables.n_states, tables.n_edges, tables.nbytes / MIB
            out["tables_version"] = tables.version
    out["peak_extra_mib"] = pm.extra / MIB
    out["peak_rss_mib"] = pm.peak / MIB
    out["rss_before_mib"] = pm.start / MIB
    out["memory_method"] = pm.method
    return out


def _tokenize_batched(tok, texts: list[str], chunk: int = 512) -> list[list[int]]:
    """The alternative to one encode/decode per label: ``tokenizer(list)`` + ``batch_decode`` per chunk,
    with the same round-trip check (512 per chunk was the fastest size here)."""
    out = []
    for lo in range(0, len(texts), chunk):
        part = texts[lo : lo + chunk]
        encoded = tok(part, add_special_tokens=False)["input_ids"]
        decoded = tok.batch_decode(encoded, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for text, ids, back in zip(part, encoded, decoded):
            if not ids or back != text:
                raise ValueError(f"label {text!r} does not survive a tokenizer round trip")
            out.append(list(ids))
    return out


def phase_labels(n: int, seed: int, repeats: int) -> dict:
    from bench._common import load_smollm2_tokenizer
    from processors import build_label_tables, tokenize_continuation

    tok = load_smollm2_tokenizer()
    labels = make_labels(n, None, seed=seed)  # build_label_tables checks every round trip itself
    with PeakMeter() as pm:
        t0 = time.perf_counter()
        lt = build_label_tables(labels, tok, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
        seconds = time.perf_counter() - t0
    # the tokenization inside it (one encode + one decode per label), against batched calls
    texts = [" " + label for label in labels]
    per_label, batched = [], []
    for _ in range(repeats):  # interleaved, so that load on the machine hits both
        t0 = time.perf_counter()
        a = [tokenize_continuation(tok, text, what="label") for text in texts]
        per_label.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = _tokenize_batched(tok, texts)
        batched.append(time.perf_counter() - t0)
        if a != b:
            raise AssertionError("batched tokenization gave other ids than encode()")
    return {
        "phase": "labels", "labels": n, "seconds": seconds, "states": lt.tables.n_states,
        "edges": lt.tables.n_edges, "peak_extra_mib": pm.extra / MIB, "rss_before_mib": pm.start / MIB,
        "memory_method": pm.method, "tokenize_per_label_s": min(per_label), "tokenize_batched_s": min(batched),
    }


# --------------------------------------------------------------------------- driver


def _r(x: float, d: int = 2) -> float:
    return round(float(x), d)


def _tree_size(me: str, n_keys: int, vocab: int, repeats: int, seed: int, workdir: str | None) -> dict:
    tmp = tempfile.TemporaryDirectory(dir=workdir)
    path = os.path.join(tmp.name, "tree.json")
    try:
        t0 = time.perf_counter()
        entries = iter_tree(n_keys, vocab, start_token_id=START, end_token_id=END, seed=seed)
        n = write_tree_json(path, entries, start_token_id=START, end_token_id=END)
        size = os.path.getsize(path)
        log(f"tree file: {n} keys, {size / MIB:.1f} MiB ({time.perf_counter() - t0:.1f} s to generate)")
        run = lambda kind: run_json_subprocess([me, "--phase", kind, "--path", path, "--vocab", str(vocab)],  # noqa: E731
                                               timeout=1800)
        runs: dict[str, list[dict]] = {"both": [], "exact": []}
        for r in range(max(1, repeats)):  # alternated, so that load on the machine hits both
            for kind in ("both", "exact"):
                if kind == "exact" and n > EXACT_MAX_KEYS:
                    continue
                res = run(kind)
                runs[kind].append(res)
                log(f"  round {r + 1} {kind:5s}: {res['seconds']:.2f} s (cpu {res['cpu_seconds']:.2f} s), "
                    f"peak +{res['peak_extra_mib']:.0f} MiB, process peak {res['peak_rss_mib']:.0f} MiB")
        phases = {kind: run(kind) for kind in ("load", "build")}
        if n <= EXACT_MAX_KEYS:
            phases["naive"] = run("naive")
    finally:
        tmp.cleanup()
    best = {kind: min(rs, key=lambda x: x["seconds"]) for kind, rs in runs.items() if rs}
    both = best["both"]
    exact = best.get("exact")
    if exact is not None and exact["tables_version"] != both["tables_version"]:
        raise AssertionError("the numpy paths and the exact paths built different tables")
    target = TIME_TARGETS_S.get(n)
    peak = max(r["peak_rss_mib"] for r in runs["both"])
    out = {
        "keys": n,
        "file_mib": _r(size / MIB, 1),
        "states": both["states"],
        "edges": both["edges"],
        "tables_mib": _r(both["tables_mib"], 1),
        "together_s": _r(both["seconds"]),
        "together_cpu_s": _r(both["cpu_seconds"]),
        "together_runs_s": [_r(x["seconds"]) for x in runs["both"]],
        "load_s_in_together": _r(both["load_seconds"]),
        "build_s_in_together": _r(both["build_seconds"]),
        "together_peak_extra_mib": _r(max(r["peak_extra_mib"] for r in runs["both"]), 0),
        "together_process_peak_mib": _r(peak, 0),
        "load_tree_s": _r(phases["load"]["seconds"]),
        "load_tree_peak_extra_mib": _r(phases["load"]["peak_extra_mib"], 0),
        "build_tree_tables_s": _r(phases["build"]["seconds"]),
        "build_tree_tables_peak_extra_mib": _r(phases["build"]["peak_extra_mib"], 0),
    }
    if exact is not None:
        out.update(exact_s=_r(exact["seconds"]), exact_cpu_s=_r(exact["cpu_seconds"]),
                   exact_runs_s=[_r(x["seconds"]) for x in runs["exact"]],
                   exact_peak_extra_mib=_r(max(r["peak_extra_mib"] for r in runs["exact"]), 0),
                   exact_over_together=ratio(exact["seconds"], both["seconds"]),
                   exact_over_together_cpu=ratio(exact["cpu_seconds"], both["cpu_seconds"]),
                   same_tables=True)
    if "naive" in phases:
        out.update(naive_json_load_s=_r(phases["naive"]["seconds"]),
                   naive_json_load_peak_extra_mib=_r(phases["naive"]["peak_extra_mib"], 0),
                   together_over_naive_time=ratio(both["seconds"], phases["naive"]["seconds"]))
    if target is not None:
        out.update(target_s=target, time_target_met=both["seconds"] <= target)
    if n >= 10_000_000:
        out.update(target_peak_mib=MEM_TARGET_BYTES // MIB, memory_target_met=peak * MIB <= MEM_TARGET_BYTES)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^5 keys, 10^4 labels (about 30 s)")
    ap.add_argument("--tree-keys", default="1000000,10000000", help="comma-separated tree sizes")
    ap.add_argument("--labels", type=int, default=100_000, help="labels to compile (0: skip)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the alternated both/exact runs (best kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the tree files go (default: a temporary directory)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.phase:  # inside a subprocess
        if args.phase == "labels":
            return phase_labels(args.labels, args.seed, args.repeats)
        return phase_tree(args.phase, args.path, args.vocab)

    sizes = [int(x) for x in str(args.tree_keys).split(",") if x.strip()]
    if args.quick:
        sizes, args.labels = [100_000], min(args.labels, 10_000)
    t_start = time.perf_counter()
    me = str(Path(__file__).resolve())
    load_before = os.getloadavg()
    trees = {str(n): _tree_size(me, n, args.vocab, args.repeats, args.seed, args.workdir) for n in sizes}
    lab = None
    if args.labels:
        lab = run_json_subprocess([me, "--phase", "labels", "--labels", str(args.labels), "--seed", str(args.seed),
                                   "--repeats", str(max(2, args.repeats))])
        log(f"labels: build_label_tables {lab['seconds']:.2f} s, peak +{lab['peak_extra_mib']:.0f} MiB; tokenization "
            f"per label {lab['tokenize_per_label_s']:.2f} s, batched {lab['tokenize_batched_s']:.2f} s")
    for n, res in trees.items():
        met = res.get("time_target_met")
        log(f"{n} keys: {res['together_s']:.2f} s (cpu {res['together_cpu_s']:.2f} s), process peak "
            f"{res['together_process_peak_mib']:.0f} MiB" + (f"; exact paths {res['exact_s']:.2f} s "
            f"(x{res['exact_over_together']})" if "exact_s" in res else "")
            + ("" if met is None else f"; target {res['target_s']} s {'met' if met else 'MISSED'}")
            + ("" if "memory_target_met" not in res else
               f"; peak < 4 GiB {'met' if res['memory_target_met'] else 'MISSED'}"))
    result: dict = {
        "benchmark": "compile",
        "memory_method": "VmHWM reset via /proc/self/clear_refs (peak_extra), ru peak of the phase's process (process_peak)",
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "trees": trees,
        "quick": args.quick,
        "seconds": _r(time.perf_counter() - t_start, 1),
    }
    if lab is not None:
        result["labels"] = {
            "labels": args.labels,
            "tokenizer": "SmolLM2-135M-Instruct (49,152 ids)",
            "build_label_tables_s": _r(lab["seconds"]),
            "build_label_tables_peak_mib": _r(lab["peak_extra_mib"], 0),
            "states": lab["states"],
            "edges": lab["edges"],
            "tokenize_per_label_s": _r(lab["tokenize_per_label_s"]),
            "tokenize_batched_s": _r(lab["tokenize_batched_s"]),
            "per_label_over_batched": ratio(lab["tokenize_per_label_s"], lab["tokenize_batched_s"]),
            "tokenize_share_of_build": ratio(lab["tokenize_per_label_s"], lab["seconds"]),
        }
    return result


if __name__ == "__main__":
    emit(main())

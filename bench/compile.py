"""Compile time and peak memory: a 10^6-key tree file and a 10^5-label set.

(a) Tree. A synthetic prefix dict of ``--tree-keys`` keys (root with ~300 candidates, depth 4-8, ids
spread over a 49,152-id vocabulary) is written as a tree JSON file (docs/design.md format), then each
phase runs in a fresh subprocess:

* ``load``:  ``config.load_tree(path, vocab_size=V)`` (streaming ijson parse + every validation rule);
* ``build``: ``processors.build_tree_tables(tree, V)`` on an already loaded tree;
* ``both``:  the two together, as ``compile_scenario`` runs them;
* ``naive``: ``json.load`` into a Python dict of lists (no validation, no tables), for comparison.

(b) Labels. ``--labels`` synthetic taxonomy labels ("Technology > AI > NLP") compiled with
``processors.build_label_tables`` for SmolLM2's tokenizer in a fresh subprocess; then, in the same
process, the tokenization it does (one ``encode`` + one ``decode`` per label, round trip checked)
is timed against batched calls (``tokenizer(list)`` + ``batch_decode``), which would be the
alternative inside ``build_label_tables``.

Peak memory: in each subprocess, the peak resident set size (``VmHWM``, the ``ru_maxrss`` of
``getrusage``) is reset through ``/proc/self/clear_refs`` once the phase's imports and inputs are
ready, and the result is the peak after the phase minus the resident size before it; the input
(e.g. the loaded tree for ``build``) is therefore not counted, only what the phase adds at its
worst moment. Where ``clear_refs`` is refused, the peak since process start is used (said in the JSON).

Targets: the tree (load + build) in at most 5 s and at most 1 GiB peak.

    python bench/compile.py [--quick] [--tree-keys 1000000] [--labels 100000]
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
TIME_TARGET_S = 5.0
MEM_TARGET_BYTES = 1 << 30
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
            t0 = time.perf_counter()
            with open(path) as fh:
                data = json.load(fh)
            prefix = data["prefix_dict"]  # already a Python dict of lists
            out["seconds"] = time.perf_counter() - t0
        out["keys"] = len(prefix)
    else:
        import config
        import processors

        tree = None
        if kind == "build":
            tree = config.load_tree(path, vocab_size=vocab)
        with PeakMeter() as pm:
            t0 = time.perf_counter()
            if tree is None:
                tree = config.load_tree(path, vocab_size=vocab)
            t1 = time.perf_counter()
            tables = None if kind == "load" else processors.build_tree_tables(tree, vocab)
            t2 = time.perf_counter()
        out["seconds"] = t2 - t0
        if kind == "both":
            out["load_seconds"], out["build_seconds"] = t1 - t0, t2 - t1
        out["keys"] = len(tree.keys)
        if tables is not None:
            out["states"], out["edges"], out["tables_mib"] = tables.n_states, tables.n_edges, tables.nbytes / MIB
    out["peak_extra_mib"] = pm.extra / MIB
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^5 keys, 10^4 labels (about 30 s)")
    ap.add_argument("--tree-keys", type=int, default=1_000_000)
    ap.add_argument("--labels", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each tree phase (the fastest is kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the tree file goes (default: a temporary directory)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.phase:  # inside a subprocess
        if args.phase == "labels":
            return phase_labels(args.labels, args.seed, args.repeats)
        return phase_tree(args.phase, args.path, args.vocab)

    if args.quick:
        args.tree_keys = min(args.tree_keys, 100_000)
        args.labels = min(args.labels, 10_000)
    t_start = time.perf_counter()
    me = str(Path(__file__).resolve())
    tmp = tempfile.TemporaryDirectory(dir=args.workdir)
    path = os.path.join(tmp.name, "tree.json")
    try:
        t0 = time.perf_counter()
        entries = iter_tree(args.tree_keys, args.vocab, start_token_id=START, end_token_id=END, seed=args.seed)
        n = write_tree_json(path, entries, start_token_id=START, end_token_id=END)
        size = os.path.getsize(path)
        log(f"tree file: {n} keys, {size / MIB:.1f} MiB ({time.perf_counter() - t0:.1f} s to generate)")

        tree: dict[str, dict] = {}
        for kind in ("load", "build", "both", "naive"):
            runs = [run_json_subprocess([me, "--phase", kind, "--path", path, "--vocab", str(args.vocab)])
                    for _ in range(max(1, args.repeats))]
            best = min(runs, key=lambda r: r["seconds"])
            best["peak_extra_mib"] = max(r["peak_extra_mib"] for r in runs)
            tree[kind] = best
            log(f"tree {kind:5s}: {best['seconds']:.2f} s, peak +{best['peak_extra_mib']:.0f} MiB")
    finally:
        tmp.cleanup()

    lab = run_json_subprocess([me, "--phase", "labels", "--labels", str(args.labels), "--seed", str(args.seed),
                               "--repeats", str(max(2, args.repeats))])
    log(f"labels: build_label_tables {lab['seconds']:.2f} s, peak +{lab['peak_extra_mib']:.0f} MiB; tokenization "
        f"per label {lab['tokenize_per_label_s']:.2f} s, batched {lab['tokenize_batched_s']:.2f} s")

    both = tree["both"]
    time_met = both["seconds"] <= TIME_TARGET_S
    mem_met = both["peak_extra_mib"] * MIB <= MEM_TARGET_BYTES
    result = {
        "benchmark": "compile",
        "memory_method": both["memory_method"],
        "tree": {
            "keys": n,
            "file_mib": _r(size / MIB, 1),
            "vocab_size": args.vocab,
            "load_tree_s": _r(tree["load"]["seconds"]),
            "load_tree_peak_mib": _r(tree["load"]["peak_extra_mib"], 0),
            "build_tree_tables_s": _r(tree["build"]["seconds"]),
            "build_tree_tables_peak_mib": _r(tree["build"]["peak_extra_mib"], 0),
            "together_s": _r(both["seconds"]),
            "together_peak_mib": _r(both["peak_extra_mib"], 0),
            "tables_mib": _r(both["tables_mib"], 1),
            "states": both["states"],
            "edges": both["edges"],
            "naive_json_load_s": _r(tree["naive"]["seconds"]),
            "naive_json_load_peak_mib": _r(tree["naive"]["peak_extra_mib"], 0),
            "together_over_naive_time": ratio(both["seconds"], tree["naive"]["seconds"]),
            "together_over_naive_peak": ratio(both["peak_extra_mib"], tree["naive"]["peak_extra_mib"]),
            "naive_note": "json.load gives a dict of lists: no validation, no decode tables",
            "target_time_s": TIME_TARGET_S,
            "target_peak_mib": MEM_TARGET_BYTES // MIB,
            "time_target_met": time_met,
            "memory_target_met": mem_met,
        },
        "labels": {
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
            "note": "build_label_tables encodes and decodes one label at a time; batched = tokenizer(list) + "
                    "batch_decode in chunks of 512 with the same round-trip check (best of interleaved runs)",
        },
        "quick": args.quick,
        "seconds": _r(time.perf_counter() - t_start, 1),
    }
    log(f"targets: {n} keys in <= {TIME_TARGET_S} s: {'met' if time_met else 'MISSED'} ({both['seconds']:.2f} s); "
        f"peak <= 1 GiB: {'met' if mem_met else 'MISSED'} ({both['peak_extra_mib']:.0f} MiB)")
    return result


if __name__ == "__main__":
    emit(main())

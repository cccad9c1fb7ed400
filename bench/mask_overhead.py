"""Cost of one decode step of the processor chain, against a naive processor, llguidance and a memory floor.

For a synthetic tree of 10^5 keys (root with ~300 candidates, depth 4-8, ids spread over the
vocabulary) and a set of 10^3 taxonomy labels, at batch 1, 8 and 64, with SmolLM2's tokenizer
(49,152 ids, logits as wide) and Qwen2.5's (151,665 ids, logits 151,936 wide: the padded ids must
be masked too), the benchmark simulates generation: each step the processor gets ``input_ids`` one
column longer and a fresh copy of the same random logits; each row then samples a token from what
the chain left allowed (Gumbel-max over the finite logits, i.e. softmax sampling like ``generate``).
A row that samples its end token takes a new request in its slot: a fresh cursor that starts at the
root on the next step (continuous batching), so every row is constrained at every step and the wide
root steps (~300 allowed ids in the tree) are part of the mix; every ``--episode`` steps a new
processor starts on a new prompt.

Timed with ``time.perf_counter_ns``, each step, on the same logits and the same allowed sets:

* ``chain``: ``ConstrainedLogitsProcessor.__call__`` (advancing per-row state + masking);
* ``naive``: a naive per-token processor (walk a Python dict trie from the generated tokens, then
  ``masked = torch.full_like(scores, -inf); for tid in valid: masked[row, tid] = scores[row, tid]``),
  on every k-th step only (``--naive-steps`` samples);
* ``llguidance``: ``llguidance.torch.apply_token_bitmask_inplace`` with the packed int32 bitmask of
  the chain's allowed set (built outside the timed region); it is ``torch.compile``d, so it is warmed
  up on every shape first (falls back to ``llguidance.numpy`` if compiling fails; the JSON says which);
* ``floor``: ``scores.fill_(-inf)``, the memory traffic any dense mask pays.

The naive and llguidance results are checked to equal the chain's, element for element.

Reported per configuration: medians per step per row, ``chain_over_floor``, ``naive_over_chain``,
``llguidance_over_chain``; means (which weigh the wide steps), and ``naive_over_chain_wide_steps``,
the paired ratio on steps where some row allows >= 100 ids (a tree root; the naive processor is
timed on every such step). ``torch`` runs single-threaded by default (``--threads``): on a shared
2-core machine a 2-thread op waits for a descheduled thread and every timing becomes ~8 ms.

Targets: chain at most 2x the floor, and at least 20x faster than naive (per configuration).

    python bench/mask_overhead.py [--quick] [--steps 200] [--naive-steps 30] [--batches 1,8,64]

``--quick`` (about 30 s): 40 steps, 8 naive steps, and ``llguidance.numpy`` (no ``torch.compile``).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._common import emit, iter_tree, load_tokenizer, log, make_labels, median, now_ns, ratio, tree_namespace  # noqa: E402
from processors import CompiledScenario, ConstrainedLogitsProcessor, RowCursor, build_label_tables, build_tree_tables  # noqa: E402

NEG_INF = float("-inf")
WARMUP_STEPS = 5
WIDE = 100  # a step is "wide" when some row allows at least this many ids (a tree root: ~300)
CHAIN_MAX_FLOOR = 2.0
NAIVE_MIN_SPEEDUP = 20.0


# --------------------------------------------------------------------------- the naive processor


class TrieNode:
    __slots__ = ("children", "is_end")

    def __init__(self):
        self.children: dict[int, TrieNode] = {}
        self.is_end = False


class NaiveTrie:
    """A Python dict trie, with the tree rule that a state with nothing allowed allows the end token."""

    def __init__(self, end_token_id: int):
        self.root = TrieNode()
        self.end = end_token_id

    def insert(self, token_ids) -> None:
        node = self.root
        for tid in token_ids:
            if tid not in node.children:
                node.children[tid] = TrieNode()
            node = node.children[tid]
        node.is_end = True

    def get_valid_next_tokens(self, prefix) -> set[int]:
        node = self.root
        for tid in prefix:
            if tid not in node.children:
                return set()
            node = node.children[tid]
        return set(node.children.keys())

    def is_complete(self, prefix) -> bool:
        node = self.root
        for tid in prefix:
            if tid not in node.children:
                return False
            node = node.children[tid]
        return node.is_end

    @classmethod
    def from_tree(cls, tree) -> "NaiveTrie":
        trie = cls(tree.end_token_id)
        nodes = {}
        keys, offsets, cands = tree.keys, tree.offsets.tolist(), tree.candidates.tolist()
        for key in keys:
            nodes[key] = TrieNode()
        sep, end = tree.sep, tree.end_token_id
        for i, key in enumerate(keys):
            node = nodes[key]
            for c in cands[offsets[i] : offsets[i + 1]]:
                if c == end:
                    node.is_end = True
                else:
                    node.children[c] = nodes.get(key + sep + str(c)) or TrieNode()
        trie.root = nodes.get(str(tree.start_token_id), TrieNode())
        return trie


class NaiveProcessor:
    """A naive trie ``LogitsProcessor`` over a batch: one trie walk and one Python loop per row."""

    def __init__(self, trie: NaiveTrie):
        self.trie = trie
        self.row_start: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(scores, NEG_INF)
        for row in range(scores.shape[0]):
            generated = input_ids[row, self.row_start[row] :].tolist()
            valid = self.trie.get_valid_next_tokens(generated)
            if self.trie.is_complete(generated):
                valid.add(self.trie.end)
            if not valid:
                valid = {self.trie.end}
            for tid in valid:
                masked[row, tid] = scores[row, tid]
        return masked


class NewRequest:
    """A fresh cursor for a slot whose previous request just ended: the slot's next column (the
    previous request's end token) is not this request's, so its first ``advance`` is skipped.
    Lives for one processor call; the driver then puts the inner cursor in its place."""

    __slots__ = ("inner", "skipped")

    def __init__(self, inner: RowCursor):
        self.inner = inner
        self.skipped = False

    def advance(self, token: int) -> None:
        if self.skipped:
            self.inner.advance(token)
        self.skipped = True

    def step(self):
        return self.inner.step()


# --------------------------------------------------------------------------- llguidance apply


def pick_llguidance(kind: str, widths: list[int], batches: list[int]):
    """``(apply_fn, name, note)``; warms ``torch.compile`` up on every shape that will be timed."""
    if kind == "off":
        return None, "off", "not measured (--llg off)"
    if kind == "torch":
        try:
            from llguidance.torch import apply_token_bitmask_inplace

            t0 = time.perf_counter()
            for w in widths:
                for b in batches:
                    logits = torch.zeros(b, w)
                    mask = torch.full((b, (w + 31) // 32), -1, dtype=torch.int32)
                    for _ in range(2):
                        apply_token_bitmask_inplace(logits, mask)
            warm = time.perf_counter() - t0
            note = f"torch.compile'd kernel, warmed up on every (batch, width) shape before timing ({warm:.1f} s)"
            return apply_token_bitmask_inplace, "llguidance.torch.apply_token_bitmask_inplace", note
        except Exception as exc:  # noqa: BLE001 - no compiler, unsupported platform...
            log(f"llguidance.torch failed ({type(exc).__name__}: {exc}); using llguidance.numpy")
    from llguidance.numpy import apply_token_bitmask_inplace as np_apply

    def apply(scores: torch.Tensor, mask: torch.Tensor) -> None:
        np_apply(scores.numpy(), mask.numpy())

    return apply, "llguidance.numpy.apply_token_bitmask_inplace", "numpy kernel on the tensor's memory"


def bitmask_of(rows: np.ndarray, cols: np.ndarray, batch: int, width: int) -> torch.Tensor:
    words = np.zeros((batch, (width + 31) // 32), dtype=np.uint32)
    np.bitwise_or.at(words, (rows, cols >> 5), np.left_shift(np.uint32(1), (cols & 31).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))


# --------------------------------------------------------------------------- one configuration


def run_config(compiled: CompiledScenario, trie: NaiveTrie, *, batch: int, width: int, vocab: int, prompt_last: int | None,
               steps: int, naive_steps: int, episode: int, prompt_len: int, llg, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    end = compiled.end_token_id
    eos = compiled.eos_token_ids
    bases = [torch.randn(batch, width, generator=gen) for _ in range(4)]
    scores = torch.empty(batch, width)
    scratch = torch.empty(batch, width)
    naive = NaiveProcessor(trie)
    total = WARMUP_STEPS + steps
    naive_every = max(1, math.ceil(steps / max(1, naive_steps)))
    chain_ns: list[int] = []
    row_ns: list[int] = []  # the per-row path (ConstrainedLogitsProcessor(vectorized=False))
    floor_ns: list[int] = []
    llg_ns: list[int] = []
    naive_ns: list[int] = []
    wide_ratios: list[float] = []  # naive / chain on the same wide step (every wide step is timed)
    allowed_counts: list[int] = []
    mismatches = {"naive": 0, "llguidance": 0, "per_row": 0}
    restarts = 0
    step = 0

    while step < total:
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
        if prompt_last is not None:
            prompt[:, -1] = prompt_last
        proc = ConstrainedLogitsProcessor(compiled, prompt_len=prompt_len, vectorized=True)
        proc_row = ConstrainedLogitsProcessor(compiled, prompt_len=prompt_len, vectorized=False)
        input_ids = prompt
        naive.row_start = [prompt_len] * batch
        for _ in range(episode):
            if step >= total:
                break
            base = bases[step % len(bases)]
            timed = step >= WARMUP_STEPS

            # the chain (vector lane) and the same chain with every row through its own cursor, in
            # alternating order, on the same logits; their outputs must be equal element for element
            for which in ((0, 1) if step % 2 else (1, 0)):
                target = scores if which == 0 else scratch
                target.copy_(base)
                t0 = now_ns()
                res = (proc if which == 0 else proc_row)(input_ids, target)
                t1 = now_ns()
                if timed:
                    (chain_ns if which == 0 else row_ns).append(t1 - t0)
            out = scores
            if not torch.equal(scratch, out):
                mismatches["per_row"] += 1
            for p in (proc, proc_row):
                for row, cursor in enumerate(p.cursors):
                    if type(cursor) is NewRequest:
                        p.cursors[row] = cursor.inner

            finite = torch.isfinite(out)
            rows_t, cols_t = finite.nonzero(as_tuple=True)
            rows, cols = rows_t.numpy(), cols_t.numpy()
            counts = np.bincount(rows, minlength=batch)
            if (counts == 0).any():
                raise AssertionError(f"step {step}: rows {np.flatnonzero(counts == 0).tolist()} have nothing allowed")
            if cols.size and cols.max() >= vocab:
                raise AssertionError(f"step {step}: id {int(cols.max())} >= tokenizer size {vocab} left allowed")
            allowed_counts.extend(counts.tolist())

            scratch.copy_(base)
            t0 = now_ns()
            scratch.fill_(NEG_INF)
            t1 = now_ns()
            if timed:
                floor_ns.append(t1 - t0)

            if llg is not None:
                mask = bitmask_of(rows, cols, batch, width)
                scratch.copy_(base)
                t0 = now_ns()
                llg(scratch, mask)
                t1 = now_ns()
                if timed:
                    llg_ns.append(t1 - t0)
                if not torch.equal(scratch, out):
                    mismatches["llguidance"] += 1

            strided = step % naive_every == 0
            wide = int(counts.max()) >= WIDE
            if strided or wide or step < WARMUP_STEPS:
                scratch.copy_(base)
                t0 = now_ns()
                res = naive(input_ids, scratch)
                t1 = now_ns()
                if timed and strided:
                    naive_ns.append(t1 - t0)
                if timed and wide:
                    wide_ratios.append((t1 - t0) / chain_ns[-1])
                if not torch.equal(res, out):
                    mismatches["naive"] += 1

            # sample from the allowed logits (Gumbel-max = softmax sampling); a row that ended takes
            # a new request, which starts at the root on the next step (the end token stays in the ids)
            g = out[rows_t, cols_t].numpy() + rng.gumbel(size=cols.size)
            order = np.lexsort((-g, rows))
            firsts = np.r_[0, np.cumsum(counts)[:-1]]
            tokens = cols[order[firsts]].astype(np.int64)
            new_len = input_ids.shape[1]
            for row in np.flatnonzero((tokens == end) | np.isin(tokens, eos)).tolist():
                proc.cursors[row] = NewRequest(RowCursor(compiled, eos_token_ids=eos))
                proc_row.cursors[row] = NewRequest(RowCursor(compiled, eos_token_ids=eos))
                naive.row_start[row] = new_len + 1
                restarts += 1
            input_ids = torch.cat([input_ids, torch.from_numpy(tokens)[:, None]], dim=1)
            step += 1

    chain = median(chain_ns) / 1e3
    per_row = median(row_ns) / 1e3
    floor = median(floor_ns) / 1e3
    naive_us = median(naive_ns) / 1e3
    llg_us = median(llg_ns) / 1e3 if llg_ns else float("nan")
    return {
        "steps": len(chain_ns),
        "naive_steps": len(naive_ns),
        "mean_allowed_per_row": round(float(np.mean(allowed_counts)), 1),
        "chain_us_per_step": round(chain, 1),
        "chain_us_per_row": round(chain / batch, 2),
        "floor_us_per_row": round(floor / batch, 2),
        "naive_us_per_row": round(naive_us / batch, 1),
        "llguidance_us_per_row": round(llg_us / batch, 2) if llg_ns else None,
        "chain_over_floor": ratio(chain, floor),
        "per_row_us_per_row": round(per_row / batch, 2),
        "per_row_over_floor": ratio(per_row, floor),
        "per_row_over_chain": ratio(per_row, chain),
        "naive_over_chain": ratio(naive_us, chain, 1),
        "llguidance_over_chain": ratio(llg_us, chain) if llg_ns else None,
        # means weigh the wide steps (a restarted row at the root of the tree: ~300 allowed ids)
        "chain_mean_us_per_row": round(float(np.mean(chain_ns)) / 1e3 / batch, 2),
        "naive_mean_us_per_row": round(float(np.mean(naive_ns)) / 1e3 / batch, 1),
        "naive_over_chain_mean": ratio(float(np.mean(naive_ns)), float(np.mean(chain_ns)), 1),
        "wide_steps": len(wide_ratios),
        "naive_over_chain_wide_steps": round(median(wide_ratios), 1) if wide_ratios else None,
        "mismatches": mismatches,
    }


# --------------------------------------------------------------------------- main


def build_constraints(name: str, tok, width: int, args) -> list[tuple[str, CompiledScenario, NaiveTrie, int | None]]:
    vocab = len(tok)
    eos = int(tok.eos_token_id)
    out = []

    t0 = time.perf_counter()
    start = vocab // 2 + 7  # an ordinary id, ends the prompt like the tree's start token would
    tree = tree_namespace(
        iter_tree(args.tree_keys, vocab, start_token_id=start, end_token_id=eos, seed=args.seed),
        start_token_id=start, end_token_id=eos,
    )
    tables = build_tree_tables(tree, vocab)
    compiled = CompiledScenario(kind="tree", constraint=tables, think=None, eos_token_ids=(eos,), vocab_size=vocab)
    trie = NaiveTrie.from_tree(tree)
    log(f"[{name}] tree: {len(tree.keys)} keys, {tables.n_edges} edges, root {len(tree.candidates[: tree.offsets[1]])} "
        f"candidates ({time.perf_counter() - t0:.1f} s)")
    out.append(("tree", compiled, trie, start))

    t0 = time.perf_counter()
    labels = make_labels(args.labels, tok, seed=args.seed)
    lt = build_label_tables(labels, tok, eos_token_id=eos, vocab_size=vocab)
    compiled = CompiledScenario(kind="labels", constraint=lt, think=None, eos_token_ids=(eos,), vocab_size=vocab)
    trie = NaiveTrie(eos)
    for label in labels:
        trie.insert(tok.encode(" " + label, add_special_tokens=False))
    log(f"[{name}] labels: {len(labels)} labels, trie of {lt.tables.n_states} states ({time.perf_counter() - t0:.1f} s)")
    out.append(("labels", compiled, trie, None))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 30 s)")
    ap.add_argument("--vocabs", default="smollm2,qwen", help="comma-separated: smollm2, qwen")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=200, help="timed chain steps per configuration")
    ap.add_argument("--naive-steps", type=int, default=30, help="timed naive steps per configuration")
    ap.add_argument("--episode", type=int, default=64, help="steps before a new processor and prompt")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tree-keys", type=int, default=100_000)
    ap.add_argument("--labels", type=int, default=1000)
    ap.add_argument("--llg", choices=("torch", "numpy", "off"), default=None,
                    help="llguidance apply to time (default: torch; numpy with --quick, to skip torch.compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: a parallel op on a shared 2-core machine waits for a descheduled thread)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps = min(args.steps, 40)
        args.naive_steps = min(args.naive_steps, 8)
    if args.llg is None:
        args.llg = "numpy" if args.quick else "torch"
    batches = [int(b) for b in args.batches.split(",")]
    vocabs = [v.strip() for v in args.vocabs.split(",") if v.strip()]

    t_start = time.perf_counter()
    toks = {}
    for name in vocabs:
        t0 = time.perf_counter()
        toks[name] = load_tokenizer(name)
        log(f"[{name}] tokenizer: {len(toks[name][0])} ids, logits width {toks[name][1]} ({time.perf_counter() - t0:.1f} s)")
    llg, llg_name, llg_note = pick_llguidance(args.llg, sorted({w for _, w in toks.values()}), batches)
    log(f"llguidance: {llg_name}: {llg_note}")

    configs = []
    for name in vocabs:
        tok, width = toks[name]
        for kind, compiled, trie, prompt_last in build_constraints(name, tok, width, args):
            for batch in batches:
                gc.collect()
                t0 = time.perf_counter()
                res = run_config(
                    compiled, trie, batch=batch, width=width, vocab=len(tok), prompt_last=prompt_last,
                    steps=args.steps, naive_steps=args.naive_steps, episode=args.episode,
                    prompt_len=args.prompt_len, llg=llg, seed=args.seed + batch,
                )
                row = {"vocab": name, "constraint": kind, "batch": batch, **res}
                configs.append(row)
                log(
                    f"[{name} {kind:6s} b={batch:3d}] chain {res['chain_us_per_row']:8.2f} us/row  "
                    f"floor {res['floor_us_per_row']:7.2f}  naive {res['naive_us_per_row']:9.1f}  "
                    f"llg {res['llguidance_us_per_row']}  | chain/floor {res['chain_over_floor']}  "
                    f"per-row/floor {res['per_row_over_floor']}  "
                    f"naive/chain {res['naive_over_chain']} (wide steps {res['naive_over_chain_wide_steps']})  "
                    f"llg/chain {res['llguidance_over_chain']}  "
                    f"({time.perf_counter() - t0:.1f} s)"
                )

    def name_of(c: dict) -> str:
        return f"{c['vocab']}/{c['constraint']}/b{c['batch']}"

    missed_floor = [name_of(c) for c in configs if not (c["chain_over_floor"] or 99) <= CHAIN_MAX_FLOOR]
    missed_naive = [name_of(c) for c in configs if not (c["naive_over_chain"] or 0) >= NAIVE_MIN_SPEEDUP]
    mismatches = {name_of(c): m for c in configs if sum((m := c.pop("mismatches")).values())}
    result = {
        "benchmark": "mask_overhead",
        "unit": "microseconds per decode step per row (median); ratios from the same run",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "vocabs": {name: {"tokenizer_size": len(tok), "logits_width": width} for name, (tok, width) in toks.items()},
        "llguidance_apply": llg_name,
        "llguidance_note": llg_note,
        "settings": {
            "tree_keys": args.tree_keys, "labels": args.labels, "batches": batches, "steps": args.steps,
            "naive_steps": args.naive_steps, "episode": args.episode, "prompt_len": args.prompt_len, "quick": args.quick,
        },
        "configs": configs,
        "targets": {
            "chain_at_most_2x_floor": {"met": not missed_floor, "missed_in": missed_floor},
            "naive_at_least_20x_chain": {"met": not missed_naive, "missed_in": missed_naive},
            # the vector lane, smollm2 (vocab 49,152), 1,000 labels, one thread
            **{f"labels_b{b}_chain_at_most_{lim:g}x_fill": {
                "met": (c := next((c for c in configs if c["vocab"] == "smollm2" and c["constraint"] == "labels"
                                   and c["batch"] == b), None)) is not None and c["chain_over_floor"] <= lim,
                "chain_over_floor": c["chain_over_floor"] if c else None,
                "per_row_over_floor": c["per_row_over_floor"] if c else None,
            } for b, lim in ((64, 2.0), (8, 3.0))},
        },
        "outputs_equal": not mismatches,
        "mismatched_steps": mismatches,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    log(f"targets: chain <= {CHAIN_MAX_FLOOR}x floor: {'met' if not missed_floor else 'MISSED in ' + ', '.join(missed_floor)}; "
        f"naive >= {NAIVE_MIN_SPEEDUP}x chain: {'met' if not missed_naive else 'MISSED in ' + ', '.join(missed_naive)}")
    return result


if __name__ == "__main__":
    emit(main())

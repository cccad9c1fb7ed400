"""Label sets compiled into a token trie (single and multi-label).

Labels are tokenized as *continuations*, ``" " + label`` without special tokens, exactly as they
will follow the prompt, and each must decode back to ``" " + label`` (BPE tokenizers split the
start of a text differently; outlines #1456). A second trie holds the *bare* form (``label``, no
space), for answers that start a message (after a chat template's assistant header, after a think
end marker or raw text ending in whitespace): :meth:`LabelTables.for_prompt` picks one per request,
the stored scenario is the same. Labels are sorted by their token sequence before the
trie is built, so every trie node covers a contiguous range ``[lo, hi)`` of label indices: in
multi-label mode a branch is closed once every label below it has been emitted, with one
prefix-sum lookup per candidate and no per-label Python work at decode time.

The end token (the model's EOS) is an edge out of every node that completes a label, so it is
allowed only at the end of a complete label. "New York" and "New York City" are both reachable:
the node after "New York" has both the EOS edge and the " City" edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import cast

import numpy as np

from config.cancel import checkpoint

from ...base import Cursor, as_ids
from ...masks import ALLOW, Step
from ...tables import DONE, LEAF, MaskTables, _freeze, content_hash
from ...tokenizer_info import hf_tokenizer

__all__ = ["LabelCursor", "LabelTables", "build_label_tables", "tokenize_continuation"]


def tokenize_continuation(tokenizer, text: str, *, what: str) -> list[int]:
    """Token ids of ``text`` as it appears after other text; refuse a lossy round trip.

    ``tokenizer``: a tokenizer or its :class:`~processors.tokenizer_info.TokenizerInfo`."""
    tokenizer = hf_tokenizer(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{what} {text!r} tokenizes to nothing")
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != text:
        raise ValueError(
            f"{what} {text!r} does not survive a tokenizer round trip: {ids} decodes to {back!r}"
        )
    return list(ids)


@dataclass(frozen=True)
class LabelTables:
    """A label trie plus what multi-label mode needs.

    Args:
        tables: the trie as :class:`MaskTables`; ``end_token_id`` is the model's EOS.
        edge_lo, edge_hi: int32 per edge, the range of label indices below that edge
            (for an EOS edge, the label the node completes).
        terminal: int32 per state, the index of the label completed at that state or -1.
        labels: the labels in trie order (for reporting and parsing; unused at decode time).
        multi_label, separator_ids, max_labels: multi-label settings.
    """

    tables: MaskTables
    edge_lo: np.ndarray
    edge_hi: np.ndarray
    terminal: np.ndarray
    labels: tuple[str, ...]
    multi_label: bool = False
    separator: str = ","
    separator_ids: tuple[int, ...] = ()
    max_labels: int | None = None
    #: the same labels tokenized without the leading space (``None``: that form does not compile, e.g. a label
    #: that does not survive the round trip without its space); see :meth:`for_prompt`
    bare_form: "LabelTables | None" = None
    version: str = field(init=False)

    def __post_init__(self) -> None:
        for name in ("edge_lo", "edge_hi", "terminal"):
            object.__setattr__(self, name, _freeze(np.asarray(getattr(self, name), dtype=np.int32)))
        object.__setattr__(
            self,
            "version",
            content_hash(
                "labels", self.tables.version, self.edge_lo, self.edge_hi, self.terminal,
                self.multi_label, self.separator_ids, self.max_labels,
                self.bare_form.version if self.bare_form is not None else None,
            ),
        )

    def __setstate__(self, state: dict) -> None:
        for name in ("edge_lo", "edge_hi", "terminal"):
            state[name] = _freeze(state[name])
        self.__dict__.update(state)

    @property
    def end_token_id(self) -> int:
        return self.tables.end_token_id

    @property
    def n_labels(self) -> int:
        return len(self.labels)

    def for_prompt(self, bare: bool) -> "LabelTables":
        """The trie for an answer that starts a message (``bare``: labels without a leading space) or continues
        text (with one); the spaced form when the bare one did not compile."""
        return self.bare_form if bare and self.bare_form is not None else self

    def parse(self, text: str) -> list[str]:
        """Split a generated answer into its labels (multi-label: on the separator)."""
        parts = text.split(self.separator) if self.multi_label else [text]
        return [p.strip() for p in parts]


def build_label_tables(
    labels: list[str],
    tokenizer,
    *,
    eos_token_id: int,
    vocab_size: int,
    multi_label: bool = False,
    separator: str = ",",
    max_labels: int | None = None,
    leading_space: bool = True,
    with_bare_form: bool = False,
) -> LabelTables:
    """Tokenize ``labels`` as continuations and compile them into :class:`LabelTables` (``tokenizer``: a
    tokenizer or its :class:`~processors.tokenizer_info.TokenizerInfo`).

    ``leading_space``: tokenize ``" " + label`` (the form that continues text) or ``label`` (the form that starts
    a message). ``with_bare_form``: also compile the form without the space into ``bare_form`` (left ``None``
    when it does not compile; the spaced form's errors are the ones raised)."""
    tokenizer = hf_tokenizer(tokenizer)
    if not labels:
        raise ValueError("labels must not be empty")
    seen: set[str] = set()
    for lab in labels:
        if lab in seen:
            raise ValueError(f"label {lab!r} appears more than once")
        seen.add(lab)
    seqs = []
    for label in labels:
        checkpoint()  # a label each: a large set is stoppable (config.cancel)
        ids = tokenize_continuation(tokenizer, " " + label if leading_space else label, what="label")
        if eos_token_id in ids:
            raise ValueError(f"label {label!r} contains the end token {eos_token_id}")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"label {label!r} tokenizes to ids outside the vocabulary: {bad}")
        seqs.append((tuple(ids), label))
    seqs.sort()
    for (a, la), (b, lb) in zip(seqs, seqs[1:]):
        if a == b:
            raise ValueError(f"labels {la!r} and {lb!r} tokenize to the same ids {list(a)}")

    # Build the trie in sorted order: node ids follow depth-first order and every node's labels
    # form the contiguous range [lo, hi).
    parent_edges: list[tuple[int, int, int]] = []  # (parent, token, child)
    node_lo: list[int] = [0]
    node_hi: list[int] = [len(seqs)]
    terminal: list[int] = [-1]
    path: list[int] = [0]  # node ids along the previous sequence; path[d] = node at depth d
    prev: tuple[int, ...] = ()
    for i, (seq, _label) in enumerate(seqs):
        if not i & 1023:
            checkpoint()
        lcp = 0
        while lcp < min(len(seq), len(prev)) and seq[lcp] == prev[lcp]:
            lcp += 1
        del path[lcp + 1 :]
        for depth in range(lcp, len(seq)):
            node = len(node_lo)
            node_lo.append(i)
            node_hi.append(i + 1)
            terminal.append(-1)
            parent_edges.append((path[-1], seq[depth], node))
            path.append(node)
        for node in path[1:]:
            node_hi[node] = i + 1
        terminal[path[-1]] = i
        prev = seq

    n_states = len(node_lo)
    edge_state = [p for p, _, _ in parent_edges]
    edge_token = [t for _, t, _ in parent_edges]
    edge_next = [c for _, _, c in parent_edges]
    edge_lo = [node_lo[c] for _, _, c in parent_edges]
    edge_hi = [node_hi[c] for _, _, c in parent_edges]
    for node, label_index in enumerate(terminal):
        if label_index >= 0:
            edge_state.append(node)
            edge_token.append(eos_token_id)
            edge_next.append(DONE)
            edge_lo.append(label_index)
            edge_hi.append(label_index + 1)
    state_arr = np.asarray(edge_state, dtype=np.int64)
    token_arr = np.asarray(edge_token, dtype=np.int64)
    order = np.lexsort((token_arr, state_arr))
    counts = np.bincount(state_arr, minlength=n_states)
    offsets = np.zeros(n_states + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    tables = MaskTables(
        offsets=offsets,
        tokens=token_arr[order].astype(np.int32),
        next_state=np.asarray(edge_next, dtype=np.int64)[order].astype(np.int32),
        root=0,
        end_token_id=int(eos_token_id),
        vocab_size=int(vocab_size),
    )

    sep_ids: tuple[int, ...] = ()
    if multi_label:
        if not separator:
            raise ValueError("separator must not be empty in multi-label mode")
        sep_ids = tuple(tokenize_continuation(tokenizer, separator, what="separator"))
        # the separator's first token must not also continue a label from a complete-label node,
        # or the cursor could not tell "next label" from "longer label"
        term_nodes = [n for n, lab in enumerate(terminal) if lab >= 0]
        for n in term_nodes:
            if sep_ids[0] in tables.allowed(n):
                raise ValueError(
                    f"separator {separator!r} starts with token {sep_ids[0]}, which also continues "
                    f"label {seqs[terminal[n]][1]!r}; choose another separator"
                )
        if max_labels is not None and max_labels < 1:
            raise ValueError(f"max_labels must be >= 1, got {max_labels}")
    bare_form = None
    if with_bare_form and leading_space:
        try:
            bare_form = build_label_tables(labels, tokenizer, eos_token_id=eos_token_id, vocab_size=vocab_size,
                                           multi_label=multi_label, separator=separator, max_labels=max_labels,
                                           leading_space=False)
        except ValueError:
            bare_form = None
    return LabelTables(
        tables=tables,
        edge_lo=np.asarray(edge_lo, dtype=np.int64)[order],
        edge_hi=np.asarray(edge_hi, dtype=np.int64)[order],
        terminal=np.asarray(terminal, dtype=np.int64),
        labels=tuple(label for _, label in seqs),
        multi_label=multi_label,
        separator=separator,
        separator_ids=sep_ids,
        max_labels=max_labels if multi_label else None,
        bare_form=bare_form,
    )


_FAR = np.iinfo(np.int32).max // 2


def _label_lengths(lt: "LabelTables") -> np.ndarray:
    """Tokens of each label (trie order): the depth of the state that completes it. Cached on the tables."""
    cached = lt.__dict__.get("_label_lengths")
    if cached is None:
        depth = _state_depths(lt)
        term = lt.terminal
        cached = np.full(lt.n_labels, _FAR, dtype=np.int64)
        states = np.flatnonzero(term >= 0)
        cached[term[states]] = depth[states]
        object.__setattr__(lt, "_label_lengths", cached)
    return cached


def _state_depths(lt: "LabelTables") -> np.ndarray:
    cached = lt.__dict__.get("_state_depths")
    if cached is None:
        tables = lt.tables
        nxt = tables.next_state.astype(np.int64)
        src = np.repeat(np.arange(tables.n_states, dtype=np.int64), np.diff(tables.offsets))
        parent = np.full(tables.n_states, -1, dtype=np.int64)
        m = nxt >= 0
        parent[nxt[m]] = src[m]
        cached = np.zeros(tables.n_states, dtype=np.int64)
        anc = parent.copy()
        while (anc >= 0).any():  # one pass per trie level
            cached += anc >= 0
            anc = np.where(anc >= 0, parent[np.maximum(anc, 0)], -1)
        object.__setattr__(lt, "_state_depths", cached)
    return cached


def _depth_of(lt: "LabelTables", state: int) -> int:
    return int(_state_depths(lt)[state])


class LabelCursor(Cursor):
    """Per-row position in a label trie, with the multi-label rules.

    Single label: the trie as is (EOS only after a complete label). Multi-label: after a complete
    label the row may emit EOS or the separator (forced token by token), then starts at the root
    again; a label is never emitted twice (a branch closes once all labels below it were emitted)
    and at most ``max_labels`` labels are emitted.
    """

    def __init__(self, lt: LabelTables):
        self.lt = lt
        self.state = lt.tables.root
        self.sep_pos: int | None = None
        self.count = 0
        self.error = None
        self._emitted: np.ndarray | None = None
        self._cum: np.ndarray | None = None
        self._end_step = Step(ALLOW, as_ids([lt.end_token_id]), lt.end_token_id)
        self.remaining: int | None = None  # tokens the row may still emit (None: no budget)

    def bind(self, *, budget: int | None = None, request=None, rules=None) -> "LabelCursor":
        """A token budget (processors.items): a label is never started, nor a separator emitted, unless a whole
        label still fits (an output stopped for length ends on a label). Per-request item controls are for
        single-label rows (the replica refuses them here)."""
        self.remaining = budget
        return self

    def spend(self, n: int = 1) -> None:
        """Tokens the row emitted outside this constraint (think mode) count against the budget."""
        if self.remaining is not None:
            self.remaining -= n

    def item_position(self) -> int:
        return self.state

    def _fits(self, state: int, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """The budget rule on a state's candidates ``ids`` (edges ``lo:hi``): the shortest label not yet emitted
        below each edge must still fit in the tokens left (the label counted from this state; the end token
        need not fit: an output may stop for length right after a whole label)."""
        remaining = self.remaining
        if remaining is None:
            return ids
        lengths = _label_lengths(self.lt)
        if remaining > int(lengths.max(initial=0)):
            return ids
        lt = self.lt
        elo, ehi = lt.edge_lo[lo:hi], lt.edge_hi[lo:hi]
        if not elo.size:
            return ids
        open_len = lengths if self._emitted is None else np.where(self._emitted > 0, _FAR, lengths)
        # the edges' label ranges tile [min lo, max hi) but follow token order; take the minima in range order
        order = np.argsort(elo, kind="stable")
        base = int(elo[order[0]])
        shortest = np.empty(elo.size, dtype=np.int64)
        shortest[order] = np.minimum.reduceat(open_len[base : int(ehi.max())], elo[order] - base)
        need = shortest - _depth_of(lt, state)  # tokens from here to the end of that label
        need = np.where(lt.tables.tokens[lo:hi] == lt.end_token_id, 0, need)
        return ids[need <= remaining]

    def _separator_fits(self, term: int) -> bool:
        """Whether the separator and a whole label not yet emitted (nor the one just completed) still fit."""
        if self.remaining is None:
            return True
        lengths = _label_lengths(self.lt)
        open_len = lengths.copy() if self._emitted is None else np.where(self._emitted > 0, _FAR, lengths)
        open_len[term] = _FAR
        return len(self.lt.separator_ids) + int(open_len.min(initial=_FAR)) <= self.remaining

    @property
    def end_token_id(self) -> int:
        return self.lt.end_token_id

    @property
    def finished(self) -> bool:
        return self.state == DONE

    @property
    def emitted(self) -> list[str]:
        """Labels completed so far, in trie order."""
        if self._emitted is None:
            return []
        return [self.lt.labels[i] for i in np.flatnonzero(self._emitted)]

    def _emit(self, label: int) -> None:
        if self._emitted is None:
            self._emitted = np.zeros(self.lt.n_labels, dtype=np.int32)
        if self._emitted[label]:
            return
        self._emitted[label] = 1
        self._cum = np.concatenate(([0], np.cumsum(self._emitted)))
        self.count += 1

    def _fail(self, token: int) -> None:
        if self.error is None:
            self.error = f"token {token} does not continue any label in state {self.state}; forcing the end token"
        self.state = LEAF

    def step(self) -> Step:
        lt = self.lt
        state = self.state
        if state < 0:
            return self._end_step
        if self.sep_pos is not None:
            return Step(ALLOW, as_ids([lt.separator_ids[self.sep_pos]]), lt.end_token_id)
        tables = lt.tables
        lo, hi = tables.offsets[state], tables.offsets[state + 1]
        ids = tables.tokens[lo:hi]
        if not lt.multi_label:
            return Step(ALLOW, self._fits(state, ids, lo, hi), lt.end_token_id)
        if self._cum is not None:
            elo, ehi = lt.edge_lo[lo:hi], lt.edge_hi[lo:hi]
            open_ = (self._cum[ehi] - self._cum[elo]) < (ehi - elo)
            if self.remaining is not None:
                ids = self._fits(state, np.where(open_, ids, -1), lo, hi)
                ids = ids[ids >= 0]
            else:
                ids = ids[open_]
        else:
            ids = self._fits(state, ids, lo, hi)
        term = int(lt.terminal[state])
        if term >= 0 and (self._emitted is None or not self._emitted[term]):
            after = self.count + 1
            room = self._separator_fits(term)
            if after < lt.n_labels and (lt.max_labels is None or after < lt.max_labels) and room:
                ids = np.append(ids, lt.separator_ids[0])
        return Step(ALLOW, ids, lt.end_token_id)

    def advance(self, token: int) -> None:
        lt = self.lt
        state = self.state
        if state == DONE:
            return
        if self.remaining is not None:
            self.remaining -= 1
        if token == lt.end_token_id:
            # EOS always ends the row; where it was not allowed (mid-label, inside the separator, a
            # repeated label) it is reported like any other invalid token
            if state >= 0 and self.error is None and token not in cast(np.ndarray, self.step().payload):
                self.error = f"end token {token} does not complete a new label in state {state}; the row ended early"
            term = int(lt.terminal[state]) if state >= 0 and self.sep_pos is None else -1
            if term >= 0:
                self._emit(term)
            self.state = DONE
            return
        if state < 0:
            self._fail(token)
            return
        if self.sep_pos is not None:
            if token != lt.separator_ids[self.sep_pos]:
                self._fail(token)
                return
            self.sep_pos += 1
            if self.sep_pos == len(lt.separator_ids):
                self.sep_pos = None
                self.state = lt.tables.root
            return
        i = lt.tables.edge(state, token)
        if i >= 0:
            self.state = int(lt.tables.next_state[i])
            return
        term = int(lt.terminal[state])
        if lt.multi_label and term >= 0 and token == lt.separator_ids[0]:
            self._emit(term)
            if len(lt.separator_ids) == 1:
                self.state = lt.tables.root
            else:
                self.sep_pos = 1
            return
        self._fail(token)

    def copy(self) -> "LabelCursor":
        new = LabelCursor.__new__(LabelCursor)
        new.__dict__.update(self.__dict__)
        if self._emitted is not None:
            new._emitted = self._emitted.copy()
        return new

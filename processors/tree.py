"""Tree decode: a ``prefix -> candidate tokens`` map as a hard constraint.

Semantics (docs/design.md "Tree file format", compatible with RTP-LLM's tree decode): the state starts
at the root key ``str(start_token_id)``; the allowed tokens are the state's candidates; after token
``t`` the state is ``state + sep + str(t)``. A state that is missing or has an empty list allows
only the end token (the row *falls back*); after the end token the row is finished and its state
no longer changes. The compiled tables hold integer states, so none of this touches a string at
decode time.
"""

from __future__ import annotations

import numpy as np

from .base import LANE_BUDGET, LANE_FILTER, LANE_OFF, LANE_PLAIN, Cursor, CursorLogitsProcessor, as_ids
from .items import ItemBook, ItemRequest, ItemRules, terminal_of
from .masks import ALLOW, Step
from .tables import DONE, LEAF, MaskTables, item_metrics

__all__ = ["TreeCursor", "TreeLogitsProcessor"]


class TreeCursor(Cursor):
    """Per-row position in a :class:`MaskTables` tree (or label trie without multi-label rules).

    Without :meth:`bind` the row follows the tables only. :meth:`bind` adds the item controls of
    :mod:`processors.items`: a token budget (a token is allowed only if the shortest way from its target to an
    item's end fits in the tokens left, so a row stopped for length ends on an item boundary), excluded and
    distinct items (a shared :class:`~processors.items.ItemRequest`), and multi-item sequences.
    """

    __slots__ = ("tables", "state", "_fell_back", "error", "_end_step", "remaining", "request", "local", "rules",
                 "path", "items", "last_edge", "_plain", "_deep")

    def __init__(self, tables: MaskTables):
        self.tables = tables
        self.state = tables.root
        self._fell_back = tables.root == LEAF
        self.error = None
        self._end_step = Step(ALLOW, as_ids([tables.end_token_id]), tables.end_token_id)
        self.remaining: int | None = None  # tokens the row may still emit (None: no budget)
        self.request: ItemRequest | None = None  # shared by the rows of one request
        self.local: ItemBook | None = None  # this row's own earlier items (multi-item, not distinct)
        self.rules = ItemRules()
        self.path: list[int] = [tables.root] if tables.root >= 0 else []  # states of the current item
        self.items = 0  # items completed by this row
        self.last_edge = -1
        self._plain = True
        self._deep = 0

    # -- item controls --------------------------------------------------------------------------
    def bind(self, *, budget: int | None = None, request: ItemRequest | None = None,
             rules: ItemRules | None = None) -> "TreeCursor":
        """Apply a token budget, a request's item controls and a scenario's multi-item rules (before the first
        token)."""
        self.remaining = budget
        self.rules = rules or ItemRules()
        if request is not None and not request.book and not request.distinct and request.base is None:
            request = None
        self.request = request
        if self.rules.max_items > 1 and not (request is not None and request.distinct):
            self.local = ItemBook()
        self._plain = budget is None and request is None and self.rules.max_items <= 1
        if budget is not None:
            self._deep = item_metrics(self.tables)[3]  # no budget check while more tokens than this are left
        if request is not None and request.distinct and self.state >= 0:
            request.book.add(self.state)  # this row occupies an item below the root
        return self

    def spend(self, n: int = 1) -> None:
        """Tokens the row emitted outside this constraint (think mode) count against the budget."""
        if self.remaining is not None:
            self.remaining -= n

    @property
    def end_token_id(self) -> int:
        return self.tables.end_token_id

    @property
    def fell_back(self) -> bool:
        return self._fell_back

    @property
    def finished(self) -> bool:
        return self.state == DONE

    def _books(self) -> list[ItemBook]:
        out = []
        if self.request is not None and self.request.book:
            out.append(self.request.book)
        if self.request is not None and self.request.base is not None:
            out.append(self.request.base)  # type: ignore[arg-type]  # read like an ItemBook
        if self.local:
            out.append(self.local)
        return out

    def _filter(self, state: int, remaining: int | None, books: list[ItemBook] | None = None) -> np.ndarray:
        """Allowed ids out of ``state`` under the budget and the books (default: the row's own)."""
        t = self.tables
        lo, hi = int(t.offsets[state]), int(t.offsets[state + 1])
        toks = t.tokens[lo:hi]
        if lo == hi:
            return toks
        nxt = t.next_state[lo:hi]
        min_rem, item_count, uniform, _ = item_metrics(t)
        tight = remaining is not None and remaining <= self._deep
        ok = None
        if tight:
            mins = np.where(nxt >= 0, min_rem[np.maximum(nxt, 0)], np.where(nxt == DONE, 0, 1))
            ok = mins <= remaining
        if books is None:
            books = self._books()
        if books:
            to_state = nxt >= 0
            used = np.zeros(nxt.shape, dtype=np.int64)
            terms = np.arange(lo, hi, dtype=np.int64)
            taken = np.zeros(nxt.shape, dtype=bool)
            for book in books:
                used += book.lookup(nxt)
                taken |= book.ends_taken(terms)
            free = np.where(to_state, item_count[np.maximum(nxt, 0)] - used >= 1, ~taken)
            ok = free if ok is None else ok & free
            if tight and not uniform:
                # min_remaining counts taken items too: make sure a free item that fits is left below each target
                assert remaining is not None
                for i in np.flatnonzero(ok & to_state):
                    if not self._reach(int(nxt[i]), remaining - 1, books):
                        ok[i] = False
        return toks if ok is None else toks[ok]

    def _reach(self, state: int, k: int, books: list[ItemBook]) -> bool:
        """Whether a free item ends in ``state`` or below it within ``k`` more tokens (not counting the end)."""
        t = self.tables
        term = terminal_of(t, state, -1)
        if term is not None and not any(term in b.ends for b in books):
            return True
        if k <= 0:
            return False
        min_rem, item_count, _, _ = item_metrics(t)
        lo, hi = int(t.offsets[state]), int(t.offsets[state + 1])
        nxt = t.next_state[lo:hi]
        for i in np.flatnonzero(nxt == LEAF):
            if not any(lo + int(i) in b.ends for b in books):
                return True
        cand = nxt[nxt >= 0].astype(np.int64)
        if not cand.size:
            return False
        used = np.zeros(cand.shape, dtype=np.int64)
        for b in books:
            used += b.lookup(cand)
        cand = cand[(min_rem[cand] <= k) & (item_count[cand] - used >= 1)]
        return any(self._reach(int(m), k - 1, books) for m in cand)

    def _terminal(self) -> int | None:
        """The terminal id of the item this row completes in its state, or None (none ends here)."""
        state = self.state
        if state == LEAF:
            return self.last_edge if self.last_edge >= 0 else None
        return terminal_of(self.tables, state, self.last_edge)

    def _term_free(self, term: int) -> bool:
        return not any(term in b.ends for b in self._books())

    def _can_continue(self, remaining: int | None) -> bool:
        """Whether a completed item may be followed by another one (multi-item rules, budget, free items)."""
        rules = self.rules
        if rules.max_items <= 1 or self.items + 1 >= rules.max_items:
            return False
        t = self.tables
        root = t.root
        if root < 0:
            return False
        if remaining is not None and rules.separator_token_id is not None and int(item_metrics(t)[0][root]) > remaining:
            return False
        books = self._books_after_claim()
        used = sum(b.count(root) for b in books)
        # distinct: this row's occupied item below the root becomes taken, and it needs another one
        if int(item_metrics(t)[1][root]) - used < 1:
            return False
        if rules.separator_token_id is not None and remaining is not None and remaining <= self._deep:
            return self._reach(root, remaining - 1, books)
        return True

    def _books_after_claim(self) -> list[ItemBook]:
        """The books as they will be once this row claims its current item (its own book gets a copy)."""
        if self.local is None:
            return self._books()
        term = self._terminal()
        local = self.local.copy()
        local.add(self.path)
        if term is not None:
            local.add_end(term)
        out = [self.request.book] if self.request is not None and self.request.book else []
        if self.request is not None and self.request.base is not None:
            out.append(self.request.base)  # type: ignore[arg-type]
        return out + [local]

    def _continuation(self, remaining: int | None) -> np.ndarray | None:
        sep = self.rules.separator_token_id
        if sep is not None:
            return as_ids([sep])
        return self._filter(self.tables.root, remaining, self._books_after_claim())

    def step(self) -> Step:
        state = self.state
        if self._plain:
            if state < 0:
                return self._end_step
            ids = self.tables.allowed(state)
            if ids.size == 0:
                self._fell_back = True
                return self._end_step
            return Step(ALLOW, ids, self.tables.end_token_id)
        if state == DONE:
            return self._end_step
        end = self.tables.end_token_id
        remaining = self.remaining
        if state == LEAF or self.tables.offsets[state] == self.tables.offsets[state + 1]:
            if state >= 0:
                self._fell_back = True
            term = self._terminal()
            if term is None or not self._term_free(term) or not self._can_continue(remaining):
                return self._end_step
            more = self._continuation(remaining)
            return Step(ALLOW, np.concatenate((as_ids([end]), more)) if more is not None else self._end_step.payload, end)
        ids = self._filter(state, remaining)
        if self.rules.max_items > 1:
            term = self._terminal()
            if term is not None and self._term_free(term) and self._can_continue(remaining):
                more = self._continuation(remaining)
                if more is not None and more.size:
                    ids = np.union1d(ids, more)
        return Step(ALLOW, ids, end)

    def _claim(self, term: int) -> None:
        """This row's current item (terminal ``term``) is done: record it where later choices look."""
        req = self.request
        if req is not None and req.distinct:
            req.book.add_end(term)  # its states already count this row's occupied item
        elif self.local is not None:
            self.local.add(self.path)
            self.local.add_end(term)
        self.items += 1

    def _restart(self) -> None:
        root = self.tables.root
        self.state = root
        self.path = [root]
        self.last_edge = -1
        req = self.request
        if req is not None and req.distinct:
            req.book.add(root)

    def advance(self, token: int) -> None:
        if self.state == DONE:
            return
        if self._plain:
            self._advance_plain(token)
            return
        if self.remaining is not None:
            self.remaining -= 1
        t = self.tables
        state = self.state
        term = self._terminal()
        if token == t.end_token_id:
            if term is None or not self._term_free(term):
                if self.error is None and state >= 0:
                    self.error = f"end token {token} does not end a free item in state {state}; the row ended early"
            if term is not None:
                self._claim(term)
            self.state = DONE
            return
        e = t.edge(state, token) if state >= 0 else -1
        if e < 0 and term is not None and self.rules.max_items > 1:
            sep = self.rules.separator_token_id
            if sep is not None and token == sep:
                self._claim(term)
                self._restart()
                return
            if sep is None:  # fixed width: the token starts the next item at the root
                self._claim(term)
                self._restart()
                state = self.state
                e = t.edge(state, token)
        if e < 0:
            if self.error is None:
                self.error = f"token {token} is not a candidate in state {state}; forcing the end token"
            self.state = LEAF
            self.last_edge = -1
            return
        nxt = int(t.next_state[e])
        self.last_edge = e
        req = self.request
        if nxt >= 0:
            self.path.append(nxt)
            if req is not None and req.distinct:
                req.book.add(nxt)
        else:
            self._fell_back = True
            if req is not None and req.distinct:
                req.book.add_end(e)  # the item is decided now
        self.state = nxt
        if self.remaining is not None and self.remaining <= 0:
            final = self._terminal()
            if final is not None:
                self._claim(final)  # stopped for length on this item: it is taken

    def _advance_plain(self, token: int) -> None:
        if token == self.tables.end_token_id:
            # the end token always finishes the row; where the state listed candidates without it,
            # it was not allowed (interference), so report it like any other invalid token
            if self.state >= 0 and self.error is None:
                ids = self.tables.allowed(self.state)
                if ids.size and self.tables.edge(self.state, token) < 0:
                    self.error = f"end token {token} is not a candidate in state {self.state}; the row ended early"
            self.state = DONE
            return
        i = self.tables.edge(self.state, token)
        if i < 0:
            if self.error is None:
                self.error = f"token {token} is not a candidate in state {self.state}; forcing the end token"
            self.state = LEAF
            return
        nxt = int(self.tables.next_state[i])
        if nxt == LEAF:
            self._fell_back = True
        self.state = nxt

    def allows(self, token: int) -> bool:
        """Whether :meth:`step` allows ``token`` now (the engine re-checks a sampled token of a distinct row
        after another row of its request took an item in the same step)."""
        payload = self.step().payload
        return payload is None or bool(np.any(payload == token))

    def vector_lane(self) -> int:
        """The plain lane without item controls; the budget lane with a token budget only (no ``exclude``,
        ``distinct`` or multi-item rules); the filter lane with a request's filter only (and maybe a budget: the
        lane leaves a row whose budget could bind to this cursor); else its own path."""
        if self._plain:
            return LANE_PLAIN
        if self.local is not None or self.rules.max_items > 1:
            return LANE_OFF
        req = self.request
        if req is None and self.remaining is not None:
            return LANE_BUDGET
        if req is not None and req.base is not None and not req.book and not req.distinct:
            return LANE_FILTER  # a filter only (beams of a distinct request share no book: they take it too)
        return LANE_OFF

    def item_position(self) -> int | None:
        """Its state; ``None`` under multi-item rules (a row that ends an item may start the next one at the root)."""
        return None if self.rules.max_items > 1 else self.state

    def release_item(self) -> None:
        request = self.request
        if request is None or not request.distinct or self.finished:
            return
        if self.path:
            request.book.add(self.path, -1)

    def copy(self) -> "TreeCursor":
        new = TreeCursor.__new__(TreeCursor)
        new.tables = self.tables
        new.state = self.state
        new._fell_back = self._fell_back
        new.error = self.error
        new._end_step = self._end_step
        new.remaining = self.remaining
        new.request = self.request
        new.local = self.local.copy() if self.local is not None else None
        new.rules = self.rules
        new.path = list(self.path)
        new.items = self.items
        new.last_edge = self.last_edge
        new._plain = self._plain
        new._deep = self._deep
        req = self.request
        if req is not None and req.distinct:  # a new row: it occupies an item below every state of its path
            req.book.add(new.path)
            if new.state == LEAF and new.last_edge >= 0:
                pass  # a decided LEAF item cannot be shared; callers copy rows before they move
        return new


class TreeLogitsProcessor(CursorLogitsProcessor):
    """Allow only the tree's candidates at each step; fall back to the end token.

    Args:
        tables: compiled tree (``processors.build_tree_tables`` or ``compile_scenario(...).constraint``).
        prompt_len: prompt length; ``None`` means the length at the first call.

    Example::

        proc = TreeLogitsProcessor(compiled.constraint)
        model.generate(ids, logits_processor=LogitsProcessorList([proc]),
                       eos_token_id=[compiled.end_token_id])
    """

    def __init__(self, tables: MaskTables, prompt_len: int | None = None):
        if not isinstance(tables, MaskTables):
            raise TypeError(f"tables must be MaskTables, got {type(tables).__name__}")
        super().__init__(lambda: TreeCursor(tables), prompt_len=prompt_len)

    @property
    def fallback_rows(self) -> list[int]:
        """Rows that reached a state with no entry (a sign of an incomplete tree)."""
        return [i for i, c in enumerate(self.cursors or []) if c.fell_back]

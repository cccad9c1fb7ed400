"""Tree decode: a ``prefix -> candidate tokens`` map as a hard constraint.

Semantics (docs/design.md "Tree file format", compatible with the production engine of seeds 000/001): the state starts
at the root key ``str(start_token_id)``; the allowed tokens are the state's candidates; after token
``t`` the state is ``state + sep + str(t)``. A state that is missing or has an empty list allows
only the end token (the row *falls back*); after the end token the row is finished and its state
no longer changes. The compiled tables hold integer states, so none of this touches a string at
decode time.
"""

from __future__ import annotations

from .base import Cursor, CursorLogitsProcessor, as_ids
from .masks import ALLOW, Step
from .tables import DONE, LEAF, MaskTables

__all__ = ["TreeCursor", "TreeLogitsProcessor"]


class TreeCursor(Cursor):
    """Per-row position in a :class:`MaskTables` tree (or label trie without multi-label rules)."""

    __slots__ = ("tables", "state", "_fell_back", "error", "_end_step")

    def __init__(self, tables: MaskTables):
        self.tables = tables
        self.state = tables.root
        self._fell_back = tables.root == LEAF
        self.error = None
        self._end_step = Step(ALLOW, as_ids([tables.end_token_id]), tables.end_token_id)

    @property
    def end_token_id(self) -> int:
        return self.tables.end_token_id

    @property
    def fell_back(self) -> bool:
        return self._fell_back

    @property
    def finished(self) -> bool:
        return self.state == DONE

    def step(self) -> Step:
        state = self.state
        if state < 0:
            return self._end_step
        ids = self.tables.allowed(state)
        if ids.size == 0:
            self._fell_back = True
            return self._end_step
        return Step(ALLOW, ids, self.tables.end_token_id)

    def advance(self, token: int) -> None:
        if self.state == DONE:
            return
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

    def copy(self) -> "TreeCursor":
        new = TreeCursor.__new__(TreeCursor)
        new.tables = self.tables
        new.state = self.state
        new._fell_back = self._fell_back
        new.error = self.error
        new._end_step = self._end_step
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

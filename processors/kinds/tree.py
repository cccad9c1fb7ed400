"""The ``tree`` kind: a token tree (inline or a tree file) compiled into :class:`~processors.tables.MaskTables`."""

from __future__ import annotations

from config import TreeScenario, load_tree
from config.settings import LimitExceeded

from ..registry import register
from ..tables import MaskTables, build_tree_tables
from ..tree import TreeCursor
from .base import CompileResult, ConstraintKind


class TreeKind(ConstraintKind):
    """Tree files and inline trees; the cursor walks the tables, the tree's own end token ends a row."""

    config_model = TreeScenario
    compiled_type = MaskTables

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        tree = load_tree(scenario.tree if scenario.tree is not None else scenario.path, vocab_size=info.vocab_size)
        tables = build_tree_tables(tree, info.vocab_size)
        return CompileResult(tables, int(tree.start_token_id) if scenario.append_start_token else None)

    def check_compiled(self, scenario, constraint, limits) -> None:
        # an inline tree was counted before compiling (config.TreeScenario.check_limits); a file only now
        if scenario.path is None:
            return
        try:
            limits.check_tree_keys(constraint.n_states, "path")
        except LimitExceeded as exc:  # the same limit, naming the file
            raise LimitExceeded(exc.field, f"{exc.what} in tree file {scenario.path}", exc.limit_name,
                                exc.limit) from None

    def cursor(self, constraint, info) -> TreeCursor:
        return TreeCursor(constraint)


register(TreeKind())

"""The ``labels`` kind: a label set compiled into a token trie (:class:`~processors.labels.LabelTables`)."""

from __future__ import annotations

from ...base import Cursor
from .trie import LabelCursor, LabelTables, build_label_tables
from ...registry import register
from ...tables import item_metrics
from ...tree import TreeCursor
from ..base import Capabilities, CompileResult, ConstraintKind
from .spec import LabelsScenario


class LabelsKind(ConstraintKind):
    """One label (the trie walked as a tree) or several joined by a separator (:class:`LabelCursor`)."""

    config_model = LabelsScenario
    compiled_type = LabelTables
    capabilities = Capabilities(items=True, patch=True)

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        return CompileResult(build_label_tables(
            list(scenario.labels), info, eos_token_id=info.eos_token_id, vocab_size=info.vocab_size,
            multi_label=scenario.multi_label, separator=scenario.separator, max_labels=scenario.max_labels,
            with_bare_form=True,  # both tokenizations: the replica picks by what precedes the answer
        ))

    def check_compiled(self, scenario, constraint, limits) -> None:
        item_metrics(constraint.tables)  # min_remaining / item_count for the item controls, computed at compile time

    def cursor(self, constraint, info) -> Cursor:
        return LabelCursor(constraint) if constraint.multi_label else TreeCursor(constraint.tables)

    def answer_form(self, constraint, bare):
        return constraint.for_prompt(bare)

    def apply_patch(self, name, body, add, remove, store, prepared=None, update=None):
        from ..patch import PatchResult, refused

        if update:
            raise refused("update: labels carry no metadata; add and remove labels instead", "update")
        from .delta import apply_labels_delta

        new_body, report = apply_labels_delta(body, add, remove)
        return PatchResult(new_body, None, report, None)

    def bare_output(self, constraint, first_token):
        """The bare form when the first token starts a label only in that form."""
        bare_form = constraint.bare_form
        if bare_form is None or first_token is None:
            return False
        return (first_token in bare_form.tables.allowed(bare_form.tables.root)
                and first_token not in constraint.tables.allowed(constraint.tables.root))

    def item_tables(self, constraint):
        return constraint.tables

    def item_controls_refusal(self, constraint):
        return "item controls apply to single-label scenarios; this one is multi_label" if constraint.multi_label else None


register(LabelsKind())

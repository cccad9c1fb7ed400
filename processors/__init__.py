"""Compiled mask tables and HuggingFace logits processors for hard-constrained decoding.

Depends on torch and numpy (and llguidance for json/json_schema/regex); never on Ray or Redis.

Public entry points (stable):

* :func:`compile_scenario` -- ``config`` scenario + tokenizer -> :class:`CompiledScenario`
* :class:`ConstrainedLogitsProcessor` -- the whole chain (think mode, constraint, multi-sequence)
  as one ``LogitsProcessor``, with one scenario per row
* :func:`build_prompt_ids` -- the prompt ids for a scenario (think begin marker, tree start token)
"""

from .base import Cursor, CursorLogitsProcessor, expand_per_row
from .chain import ConstrainedLogitsProcessor, RowCursor, constraint_cursor
from .compile import CompiledScenario, build_prompt_ids, compile_scenario, eos_token_ids
from .grammar import GrammarCursor, GrammarSpec, compile_json_schema, compile_regex, get_lltokenizer
from .labels import LabelCursor, LabelTables, build_label_tables, tokenize_continuation
from .masks import ALLOW, BAN, BITMASK, FREE, Step, apply_steps, bitmask_to_ids, bitmask_words
from .multiseq import MultiSeqCursor, MultiSeqLogitsProcessor
from .tables import DONE, LEAF, MaskTables, build_tree_tables, content_hash
from .think import ThinkCursor, ThinkModeLogitsProcessor, ThinkSpec, compile_think
from .tree import TreeCursor, TreeLogitsProcessor

__all__ = [
    "ALLOW",
    "BAN",
    "BITMASK",
    "DONE",
    "FREE",
    "LEAF",
    "CompiledScenario",
    "ConstrainedLogitsProcessor",
    "Cursor",
    "CursorLogitsProcessor",
    "GrammarCursor",
    "GrammarSpec",
    "LabelCursor",
    "LabelTables",
    "MaskTables",
    "MultiSeqCursor",
    "MultiSeqLogitsProcessor",
    "RowCursor",
    "Step",
    "ThinkCursor",
    "ThinkModeLogitsProcessor",
    "ThinkSpec",
    "TreeCursor",
    "TreeLogitsProcessor",
    "apply_steps",
    "bitmask_to_ids",
    "bitmask_words",
    "build_label_tables",
    "build_prompt_ids",
    "build_tree_tables",
    "compile_json_schema",
    "compile_regex",
    "compile_scenario",
    "compile_think",
    "constraint_cursor",
    "content_hash",
    "eos_token_ids",
    "expand_per_row",
    "get_lltokenizer",
    "tokenize_continuation",
]

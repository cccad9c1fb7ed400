"""Compiled mask tables and HuggingFace logits processors for hard-constrained decoding.

Depends on torch and numpy (and llguidance for json/json_schema/regex); never on Ray or Redis.

Public entry points (stable):

* :class:`ScenarioCompiler` -- the scenario pipeline: body -> limits -> :class:`CompiledScenario` (bounded,
  cached, one :class:`ScenarioError` per failure); what the services use
* :func:`compile_scenario` -- ``config`` scenario + tokenizer -> :class:`CompiledScenario`
* :class:`TokenizerInfo` -- what the constraint code needs of a tokenizer, built once per tokenizer; every
  function below that takes a tokenizer also takes one
* :mod:`processors.registry` -- the scenario kinds (``processors/kinds/``, one module per kind)
* :class:`ConstrainedLogitsProcessor` -- the whole chain (think mode, constraint, multi-sequence)
  as one ``LogitsProcessor``, with one scenario per row
* :func:`build_prompt_ids` -- the prompt ids for a scenario (think begin marker, tree start token)
"""

from . import registry
from .base import Cursor, CursorLogitsProcessor, expand_per_row
from .chain import ConstrainedLogitsProcessor, RowCursor, constraint_cursor
from .compile import CompiledScenario, build_prompt_ids, compile_scenario, eos_token_ids
from .grammar import GrammarCursor, GrammarSpec, compile_json_schema, compile_regex, get_lltokenizer
from .labels import LabelCursor, LabelTables, build_label_tables, tokenize_continuation
from .masks import ALLOW, BAN, BITMASK, FREE, Step, apply_steps, bitmask_to_ids, bitmask_words
from .multiseq import MultiSeqCursor, MultiSeqLogitsProcessor
from .tables import DONE, LEAF, MaskTables, build_tree_tables, content_hash
from .think import ThinkCursor, ThinkModeLogitsProcessor, ThinkSpec, compile_think
from .tokenizer_info import TokenizerInfo
from .tree import TreeCursor, TreeLogitsProcessor
from .kinds import CompileResult, ConstraintKind  # noqa: E402  (registers every kind)
from .pipeline import ScenarioCompiler, ScenarioError  # noqa: E402

__all__ = [
    "ALLOW",
    "BAN",
    "BITMASK",
    "DONE",
    "FREE",
    "LEAF",
    "CompileResult",
    "CompiledScenario",
    "ConstrainedLogitsProcessor",
    "ConstraintKind",
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
    "ScenarioCompiler",
    "ScenarioError",
    "Step",
    "ThinkCursor",
    "ThinkModeLogitsProcessor",
    "ThinkSpec",
    "TokenizerInfo",
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
    "registry",
    "tokenize_continuation",
]

"""Compiled mask tables and HuggingFace logits processors for hard-constrained decoding.

Depends on torch and numpy (and llguidance for json/json_schema/regex); never on Ray or Redis.

Public entry points (stable):

* :class:`ScenarioCompiler` -- the scenario pipeline: body -> limits -> :class:`CompiledScenario` (bounded,
  cached, one :class:`ScenarioError` per failure); what the services use
* :func:`compile_scenario` -- ``config`` scenario + tokenizer -> :class:`CompiledScenario`
* :class:`TokenizerInfo` -- what the constraint code needs of a tokenizer, built once per tokenizer; every
  function below that takes a tokenizer also takes one
* :mod:`processors.registry` -- the scenario kinds (``processors/kinds/``, one package per kind)
* :class:`ConstrainedLogitsProcessor` -- the whole chain (think mode, constraint, multi-sequence)
  as one ``LogitsProcessor``, with one scenario per row
* :func:`build_prompt_ids` -- the prompt ids for a scenario (think begin marker, tree start token)
"""

import importlib
from typing import Any

#: public name -> the submodule that defines it. Imported on first use (PEP 562), so that importing a torch-free
#: part of this package (a kind's spec, which ``config`` imports to build its union) loads no torch.
_EXPORTS: dict[str, str] = {
    "Cursor": "base",
    "CursorLogitsProcessor": "base",
    "expand_per_row": "base",
    "ConstrainedLogitsProcessor": "chain",
    "RowCursor": "chain",
    "constraint_cursor": "chain",
    "CompiledScenario": "compile",
    "build_prompt_ids": "compile",
    "compile_scenario": "compile",
    "eos_token_ids": "compile",
    "GrammarCursor": "grammar",
    "GrammarSpec": "grammar",
    "compile_json_schema": "grammar",
    "compile_regex": "grammar",
    "get_lltokenizer": "grammar",
    "LabelCursor": "labels",
    "LabelTables": "labels",
    "build_label_tables": "labels",
    "tokenize_continuation": "labels",
    "ALLOW": "masks",
    "BAN": "masks",
    "BITMASK": "masks",
    "FREE": "masks",
    "Step": "masks",
    "apply_steps": "masks",
    "bitmask_to_ids": "masks",
    "bitmask_words": "masks",
    "MultiSeqLogitsProcessor": "multiseq",
    "DONE": "tables",
    "LEAF": "tables",
    "MaskTables": "tables",
    "build_tree_tables": "tables",
    "content_hash": "tables",
    "ThinkCursor": "think",
    "ThinkModeLogitsProcessor": "think",
    "ThinkSpec": "think",
    "compile_think": "think",
    "TokenizerInfo": "tokenizer_info",
    "TreeCursor": "tree",
    "TreeLogitsProcessor": "tree",
    "CompileResult": "kinds",
    "ConstraintKind": "kinds",
    "ScenarioCompiler": "pipeline",
    "ScenarioError": "pipeline",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["registry", *_EXPORTS]  # the submodule, and every name above

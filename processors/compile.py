"""Scenario -> compiled constraint, and the prompt that goes with it.

:func:`compile_scenario` turns a validated ``config`` scenario into a :class:`CompiledScenario`:
immutable, picklable, versioned by content, tied to one tokenizer's vocabulary. This is the unit
the config manager compiles once and ships to every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from .grammar import GrammarSpec, compile_json_schema, compile_regex
from .labels import LabelTables, build_label_tables
from .tables import MaskTables, build_tree_tables, content_hash
from .think import ThinkSpec, compile_think
from .special_tokens import contains_special_tokens, encode_chat, encode_segments

__all__ = ["CompiledScenario", "Constraint", "build_prompt_ids", "compile_scenario", "eos_token_ids"]

Constraint = Union[MaskTables, LabelTables, GrammarSpec]


def eos_token_ids(tokenizer, model_config=None) -> tuple[int, ...]:
    """The model's EOS ids: the tokenizer's, plus those of a generation config when given."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    extra = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(extra, int):
        extra = [extra]
    for t in extra or []:
        if int(t) not in ids:
            ids.append(int(t))
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set one")
    return tuple(ids)


@dataclass(frozen=True)
class CompiledScenario:
    """Everything a replica needs to constrain rows of one scenario.

    Args:
        kind: the scenario ``type``.
        constraint: :class:`MaskTables` (tree), :class:`LabelTables` (labels), :class:`GrammarSpec`
            (json / json_schema / regex).
        think: compiled think settings, or ``None``.
        eos_token_ids: the model's EOS ids (a finished row may emit only its end token).
        vocab_size: the tokenizer vocabulary the scenario was compiled for.
        start_token_id: tree root token appended to the prompt (``append_start_token``), else ``None``.
        settings: generation defaults and ``system_prompt`` carried by the scenario.
    """

    kind: str
    constraint: Constraint | None
    think: ThinkSpec | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    start_token_id: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    version: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "version",
            content_hash(
                self.kind,
                self.constraint.version if self.constraint is not None else None,
                self.think.version if self.think is not None else None,
                self.eos_token_ids,
                self.vocab_size,
                self.start_token_id,
                sorted(self.settings.items()),
            ),
        )

    @property
    def end_token_id(self) -> int:
        """The token that ends a row of this scenario (the tree's end token, else EOS)."""
        if self.constraint is not None:
            return int(self.constraint.end_token_id)
        return int(self.eos_token_ids[0])

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a row: pass them as ``eos_token_id`` to ``generate``."""
        end = self.end_token_id
        return (end,) + tuple(t for t in self.eos_token_ids if t != end)


def compile_scenario(scenario, tokenizer, *, model_config=None, grammar_worker=None) -> CompiledScenario:
    """Compile a ``config`` scenario for ``tokenizer``.

    ``grammar_worker``: a :class:`~processors.compile_worker.GrammarWorker` that builds and checks
    json/json_schema/regex grammars in its own process, bounded in time and memory (it raises
    :class:`~processors.compile_worker.CompileLimitError` past a limit); ``None``: in this process.

    Raises ``ValueError`` with a message naming the problem (an id outside the vocabulary, a label
    that does not round-trip, an invalid grammar, a think marker that does not tokenize).
    """
    from config import load_tree

    vocab = len(tokenizer)
    eos = eos_token_ids(tokenizer, model_config)
    kind = scenario.type
    start = None
    if kind == "tree":
        tree = load_tree(scenario.tree if scenario.tree is not None else scenario.path, vocab_size=vocab)
        constraint: Constraint | None = build_tree_tables(tree, vocab)
        if scenario.append_start_token:
            start = int(tree.start_token_id)
    elif kind == "labels":
        constraint = build_label_tables(
            list(scenario.labels),
            tokenizer,
            eos_token_id=eos[0],
            vocab_size=vocab,
            multi_label=scenario.multi_label,
            separator=scenario.separator,
            max_labels=scenario.max_labels,
        )
    elif kind == "json_schema":
        constraint = compile_json_schema(scenario.json_schema, tokenizer, eos_token_id=eos[0], worker=grammar_worker)
    elif kind == "json":
        constraint = compile_json_schema(None, tokenizer, eos_token_id=eos[0], worker=grammar_worker)
    elif kind == "regex":
        constraint = compile_regex(scenario.pattern, tokenizer, eos_token_id=eos[0], worker=grammar_worker)
    else:  # pragma: no cover - the config models are a closed union
        raise ValueError(f"unknown scenario type {kind!r}")
    think = None
    if scenario.think is not None:
        think = compile_think(scenario.think.max_thinking_tokens, scenario.think.begin, scenario.think.end, tokenizer)
    settings = {
        k: getattr(scenario, k)
        for k in ("max_new_tokens", "temperature", "top_p", "top_k", "system_prompt")
        if getattr(scenario, k, None) is not None
    }
    return CompiledScenario(
        kind=kind,
        constraint=constraint,
        think=think,
        eos_token_ids=eos,
        vocab_size=vocab,
        start_token_id=start,
        settings=settings,
    )


def build_prompt_ids(
    compiled: CompiledScenario | None,
    tokenizer,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    special_tokens_in_content: bool = False,
) -> list[int]:
    """Token ids of the prompt for one request of a scenario.

    ``prompt`` is raw text; ``messages`` go through the tokenizer's chat template (with the
    scenario's ``system_prompt`` first when it has one and the messages do not). The think begin
    marker is appended when the text does not already end with it; otherwise the tree's start token
    is appended when the ids do not already end with it (``append_start_token``). With think mode
    the constraint starts right after the end marker, at the root.

    A special token spelled in the prompt, in a message or in the system prompt (``<|im_end|>``) stays text
    unless ``special_tokens_in_content``: only the chat template's own markers are control tokens (see
    :mod:`processors.special_tokens`). Text that spells none is tokenized as it always was.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    settings = compiled.settings if compiled is not None else {}
    if messages is not None:
        msgs = list(messages)
        system = settings.get("system_prompt")
        if system and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        contents = [m.get("content") for m in msgs]
    else:
        text = prompt
        contents = [prompt]
    think = compiled.think if compiled is not None else None
    suffix = think.begin if think is not None and not text.endswith(think.begin) else ""
    if special_tokens_in_content or not contains_special_tokens(tokenizer, contents):
        ids = list(tokenizer.encode(text + suffix, add_special_tokens=False))
    elif messages is not None:
        ids = encode_chat(tokenizer, msgs, text, suffix)
    else:
        ids = encode_segments(tokenizer, [(prompt, False), (suffix, True)])
    if think is None and compiled is not None and compiled.start_token_id is not None:
        if not ids or ids[-1] != compiled.start_token_id:
            ids.append(compiled.start_token_id)
    return ids

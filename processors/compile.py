"""Scenario -> compiled constraint, and the prompt that goes with it.

:func:`compile_scenario` turns a validated ``config`` scenario into a :class:`CompiledScenario`:
immutable, picklable, versioned by content, tied to one tokenizer's vocabulary. This is the unit
the config manager compiles once and ships to every replica. The scenario's kind (looked up in
:mod:`processors.registry`) compiles the constraint; think mode and the generation defaults are the
same for every kind. Limits, timeouts and one message per failure are added by
:mod:`processors.pipeline`, which the services use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from . import registry
from .kinds.base import Capabilities, ConstraintKind
from .tables import content_hash
from .think import ThinkSpec, compile_think
from .special_tokens import contains_special_tokens, encode_chat, encode_segments
from .tool_prompt import render_tools
from .tokenizer_info import TokenizerInfo, hf_tokenizer

__all__ = ["CompiledScenario", "Constraint", "PromptTooLong", "build_prompt_ids", "compile_scenario", "eos_token_ids"]

#: a compiled constraint: an instance of its kind's ``compiled_type`` (MaskTables, LabelTables, GrammarSpec, ...)
Constraint = Any


def eos_token_ids(tokenizer, model_config=None) -> tuple[int, ...]:
    """The model's EOS ids: the tokenizer's, plus those of a generation config when given."""
    ids = TokenizerInfo.of(tokenizer, model_config=model_config).eos_token_ids
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set one")
    return ids


@dataclass(frozen=True)
class CompiledScenario:
    """Everything a replica needs to constrain rows of one scenario.

    Args:
        kind: the scenario ``type``.
        constraint: what the kind compiled (:class:`MaskTables` for a tree, :class:`LabelTables` for labels,
            :class:`GrammarSpec` for json / json_schema / regex), or ``None``.
        think: compiled think settings, or ``None``.
        eos_token_ids: the model's EOS ids (a finished row may emit only its end token).
        vocab_size: the tokenizer vocabulary the scenario was compiled for.
        start_token_id: tree root token appended to the prompt (``append_start_token``), else ``None``.
        settings: generation defaults and ``system_prompt`` carried by the scenario.
        extras: what the kind keeps beside its compiled object (:attr:`~processors.kinds.base.CompileResult.extras`,
            JSON data: a stored tool set's tools for the prompt and how its output is read), read back through
            the kind's hooks (:attr:`constraint_kind`); ``None`` for most kinds. It travels with the compiled
            version (and is part of it), so a request is read as the version that decoded it says.
    """

    kind: str
    constraint: Constraint | None
    think: ThinkSpec | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    start_token_id: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] | None = None
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
                *([json.dumps(self.extras, sort_keys=True)] if self.extras is not None else []),
            ),
        )

    @property
    def capabilities(self) -> Capabilities:
        """What this scenario's kind can do (:class:`~processors.kinds.base.Capabilities`); engines and the
        replica branch on it, not on the kind's name or compiled type. Nothing, for a kind not registered."""
        try:
            return registry.get(self.kind).capabilities
        except ValueError:
            return Capabilities()

    @property
    def constraint_kind(self) -> ConstraintKind | None:
        """This scenario's kind (:class:`~processors.kinds.base.ConstraintKind`), whose hooks read its compiled
        object and extras; None for a kind not registered."""
        try:
            return registry.get(self.kind)
        except ValueError:
            return None

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


def compile_scenario(scenario, tokenizer, *, model_config=None, grammar_worker=None, prebuilt=None) -> CompiledScenario:
    """Compile a ``config`` scenario for ``tokenizer`` (a tokenizer or its :class:`TokenizerInfo`).

    ``prebuilt``: what the kind would build, already built by the caller in its own way (the config manager builds
    a catalog's tables straight from its items, or an inline tree's from the split body); the kind finishes the
    compile from it (:meth:`~processors.kinds.base.ConstraintKind.compile_prebuilt`).

    ``grammar_worker``: a :class:`~processors.compile_worker.GrammarWorker` that builds and checks
    json/json_schema/regex grammars in its own process, bounded in time and memory (it raises
    :class:`~processors.compile_worker.CompileLimitError` past a limit); ``None``: in this process.

    Raises ``ValueError`` with a message naming the problem (an id outside the vocabulary, a label
    that does not round-trip, an invalid grammar, a think marker that does not tokenize).
    """
    info = TokenizerInfo.of(tokenizer, model_config=model_config)
    eos = eos_token_ids(info)
    kind = registry.get(scenario.type)
    if prebuilt is not None:
        built = kind.compile_prebuilt(scenario, info, prebuilt)
    else:
        built = kind.compile(scenario, info, worker=grammar_worker)
    think = None
    if scenario.think is not None:
        think = compile_think(scenario.think.max_thinking_tokens, scenario.think.begin, scenario.think.end, info)
    settings = {
        k: getattr(scenario, k)
        for k in ("max_new_tokens", "temperature", "top_p", "top_k", "system_prompt", "filter")
        if getattr(scenario, k, None) is not None
    }
    if getattr(scenario, "max_items", 1) > 1:  # multi-item tree rows (processors.items.item_rules)
        settings["max_items"] = scenario.max_items
        settings["separator_token_id"] = scenario.separator_token_id
    return CompiledScenario(
        kind=scenario.type,
        constraint=built.constraint,
        think=think,
        eos_token_ids=eos,
        vocab_size=info.vocab_size,
        start_token_id=built.start_token_id,
        settings=settings,
        extras=built.extras,
    )


class PromptTooLong(ValueError):
    """A prompt's text is longer in bytes than :func:`build_prompt_ids` was allowed to tokenize
    (``max_text_bytes``); ``text_bytes``: its length (at least ``max_text_bytes + 1``)."""

    def __init__(self, text_bytes: int, max_text_bytes: int):
        super().__init__(f"the prompt's text is {text_bytes} bytes, more than {max_text_bytes}")
        self.text_bytes = text_bytes
        self.max_text_bytes = max_text_bytes


def _check_text_bytes(text: str, limit: int) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))  # milliseconds per megabyte; a lone surrogate is 3 bytes
    if size > limit:
        raise PromptTooLong(size, limit)


def build_prompt_ids(
    compiled: CompiledScenario | None,
    tokenizer,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    special_tokens_in_content: bool = False,
    tools: list[dict] | None = None,
    max_text_bytes: int | None = None,
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
    ``tokenizer``: a tokenizer or its :class:`TokenizerInfo`. ``tools`` (OpenAI function tools) and tool-call
    turns in ``messages`` are rendered by :func:`processors.tool_prompt.render_tools`; without ``tools``, the
    scenario's own (its kind's :meth:`~processors.kinds.base.ConstraintKind.prompt_tools`: a stored tool set's) are.

    ``max_text_bytes``: a text (the rendered chat, or the prompt) longer than this in UTF-8 bytes raises
    :class:`PromptTooLong` before it is tokenized (tokenizing is linear but slow: seconds for megabytes).
    """
    tokenizer = hf_tokenizer(tokenizer)
    if tools is None and compiled is not None and compiled.extras is not None:
        kind = compiled.constraint_kind
        tools = kind.prompt_tools(compiled.extras) if kind is not None else None
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    settings = compiled.settings if compiled is not None else {}
    if messages is not None:
        msgs = list(messages)
        system = settings.get("system_prompt")
        if system and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system})
        msgs, template_tools = render_tools(msgs, tools, tokenizer)
        extra = {"tools": template_tools} if template_tools else {}
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)
        contents = [m.get("content") for m in msgs]
    else:
        text = prompt
        contents = [prompt]
    think = compiled.think if compiled is not None else None
    suffix = think.begin if think is not None and not text.endswith(think.begin) else ""
    if max_text_bytes is not None:
        _check_text_bytes(text + suffix, max_text_bytes)
    if special_tokens_in_content or not contains_special_tokens(tokenizer, contents):
        ids = list(tokenizer.encode(text + suffix, add_special_tokens=False))
    elif messages is not None:
        ids = encode_chat(tokenizer, msgs, text, suffix, tools=template_tools)
    else:
        ids = encode_segments(tokenizer, [(prompt or "", False), (suffix, True)])
    if think is None and compiled is not None and compiled.start_token_id is not None:
        if not ids or ids[-1] != compiled.start_token_id:
            ids.append(compiled.start_token_id)
    return ids

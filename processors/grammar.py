"""JSON, JSON-schema, regex and Lark-grammar constraints backed by llguidance.

A :class:`GrammarSpec` is the compiled, picklable form: the llguidance grammar string, checked
against the tokenizer at compile time. Matchers (per-row parser state) are created from it on the
replica that decodes, with the ``LLTokenizer`` of its :class:`~processors.tokenizer_info.TokenizerInfo`
(built once per tokenizer: about 0.4 s for a 49k vocabulary). Every function here takes a tokenizer or
its ``TokenizerInfo``.

JSON grammars are compiled with ``whitespace_flexible: False``: no free whitespace between tokens,
so a small model cannot loop on spaces until ``max_new_tokens`` (a trap reported by vLLM users).
Remote ``$ref``s are never fetched: llguidance resolves only local references and refuses others.

Building and checking a grammar is the step whose cost can explode (time and memory exponential in a
small schema): the service runs it in a bounded worker process (``processors.compile_worker``), passed
as ``worker=``; without one it runs here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from .base import Cursor, as_ids
from .compile_worker import build_grammar
from .masks import ALLOW, BITMASK, Step, bitmask_words
from .schema_check import admits_repeated_keys, grammar_schema, validator_for_schema
from .tables import content_hash
from .tokenizer_info import TokenizerInfo

__all__ = [
    "ENDED_EARLY",
    "GrammarCursor",
    "GrammarSpec",
    "compile_grammar",
    "compile_json_schema",
    "compile_regex",
    "get_lltokenizer",
    "new_matcher",
]

#: the error of a row that emitted its end token before its grammar accepted
ENDED_EARLY = "the row ended before the grammar accepted"

JSON_OPTIONS = {"whitespace_flexible": False}


def get_lltokenizer(tokenizer):
    """The llguidance tokenizer of a tokenizer (built once per tokenizer: :attr:`TokenizerInfo.lltokenizer`).

    Its EOS is the tokenizer's ``eos_token_id``: llguidance allows it once the grammar accepts.
    """
    return TokenizerInfo.of(tokenizer).lltokenizer


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar checked against one tokenizer.

    Args:
        kind: the scenario kind it was compiled for (``json``, ``json_schema``, ``regex``, ``grammar``; for
            reporting and its version only: nothing branches on it).
        grammar: the llguidance grammar string.
        eos_token_id: the token that ends a row once the grammar accepts.
        vocab_size: the tokenizer vocabulary it was checked against.
        schema: ``json_schema``: the schema as written (JSON text), which finished outputs are validated against.
        unenforced: what the grammar does not enforce (``json_schema``): one note per keyword the compile removed
            or weakened, naming its place (``not at #/properties/a``); empty when the grammar is the schema.
        repeatable_keys: the grammar may repeat an object key (a key no ``properties`` entry declares).
        validates: finished outputs are validated (the JSON kinds): a strict JSON parse, then ``schema`` if any.
    """

    kind: str
    grammar: str
    eos_token_id: int
    vocab_size: int
    schema: str | None = None
    unenforced: tuple[str, ...] = ()
    repeatable_keys: bool = False
    validates: bool = False
    version: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", content_hash("grammar", self.kind, self.grammar, self.eos_token_id,
                                                         self.vocab_size, self.schema or "", list(self.unenforced)))

    @property
    def end_token_id(self) -> int:
        return self.eos_token_id

    @property
    def exact(self) -> bool:
        """Whether every output the grammar completes is valid (no validation can fail): a regex, a Lark grammar,
        or a schema enforced as written whose objects cannot repeat a key."""
        return not self.validates or (not self.unenforced and not self.repeatable_keys)

    def output_error(self, text: str) -> str | None:
        """Why a finished output's text is not valid for this constraint (``None``: it is). Regexes
        and Lark grammars are enforced exactly by their grammar and not checked again."""
        if not self.validates:
            return None
        return validator_for_schema(self.schema).error(text)


def _grammar(form: str, source: str, info: TokenizerInfo, worker) -> tuple[str, list[str]]:
    if worker is None:
        return build_grammar(form, source, info.lltokenizer, JSON_OPTIONS)
    if worker.vocab_size != info.vocab_size:
        raise ValueError(f"the compile worker was built for a vocabulary of {worker.vocab_size}, "
                         f"this tokenizer has {info.vocab_size}")
    return worker.build(form, source, JSON_OPTIONS)


def compile_grammar(form: str, source: str, tokenizer, *, kind: str, eos_token_id: int, worker=None) -> GrammarSpec:
    """Compile ``source`` in one of llguidance's source forms (``regex``, ``lark``; JSON schemas go through
    :func:`compile_json_schema`) into a :class:`GrammarSpec` for the scenario kind ``kind``; ``worker`` as for
    :func:`compile_json_schema`. Its outputs need no check after generation (:attr:`GrammarSpec.exact`). A kind
    whose spec is one of these forms compiles with this alone (``processors/kinds/regex``, ``.../grammar``)."""
    info = TokenizerInfo.of(tokenizer)
    grammar, _ = _grammar(form, source, info, worker)
    return GrammarSpec(kind=kind, grammar=grammar, eos_token_id=int(eos_token_id), vocab_size=info.vocab_size)


def compile_json_schema(schema: dict | None, tokenizer, *, eos_token_id: int, worker=None) -> GrammarSpec:
    """Compile a JSON schema (``None`` or ``{}``: any JSON value) into a :class:`GrammarSpec`.

    The grammar is the schema's closest enforceable relaxation (``processors.schema_check``): keywords the
    grammar library refuses are left out of it and listed in :attr:`GrammarSpec.unenforced`; an object schema
    that declares its keys and says nothing of others generates only those
    (:func:`~processors.schema_check.close_objects`); finished outputs are validated against the schema as written
    (:meth:`GrammarSpec.output_error`).

    ``worker``: a :class:`~processors.compile_worker.GrammarWorker` to build and check the grammar in its
    process, within its time and memory limits; ``None``: in this process, unbounded.
    """
    info = TokenizerInfo.of(tokenizer)
    kind = "json" if not schema else "json_schema"
    grammar, notes = _grammar("json_schema", json.dumps(schema or {}), info, worker)
    return GrammarSpec(kind=kind, grammar=grammar, eos_token_id=int(eos_token_id), vocab_size=info.vocab_size,
                       schema=json.dumps(schema) if schema else None, unenforced=tuple(notes), validates=True,
                       repeatable_keys=admits_repeated_keys(grammar_schema(schema)[0] if schema else None))


def compile_regex(pattern: str, tokenizer, *, eos_token_id: int, worker=None) -> GrammarSpec:
    """Compile a regular expression (Rust ``regex`` syntax, whole-output match); ``worker`` as for
    :func:`compile_json_schema`."""
    return compile_grammar("regex", pattern, tokenizer, kind="regex", eos_token_id=eos_token_id, worker=worker)


def new_matcher(spec: GrammarSpec, tokenizer):
    """A fresh llguidance matcher for one row (``tokenizer``: a tokenizer or its ``TokenizerInfo``)."""
    import llguidance

    lltok = TokenizerInfo.of(tokenizer).lltokenizer
    if spec.vocab_size != lltok.vocab_size:
        raise ValueError(
            f"grammar was compiled for a vocabulary of {spec.vocab_size}, this tokenizer has {lltok.vocab_size}"
        )
    return llguidance.LLMatcher(lltok, spec.grammar, log_level=0)


#: llguidance's stop reasons that end a row, in words
_STOP_REASONS = {
    "NoExtensionBias": "the grammar allows no token here (no sentence of it continues this text: its language may "
                       "be empty, e.g. a rule that never ends)",
    "NoExtension": "the grammar allows no token here",
}


def matcher_error(matcher) -> str:
    """What went wrong in an llguidance matcher, in one line (its message carries its whole parser state)."""
    text = (matcher.get_error() or "").strip()
    first = text.splitlines()[0].strip() if text else "unknown error"
    return _STOP_REASONS.get(first, first[:200])


def fill_bitmask(matcher, out: np.ndarray) -> None:
    """Write the matcher's next-token bitmask into ``out`` (int32, contiguous)."""
    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)


class GrammarCursor(Cursor):
    """Per-row llguidance matcher. EOS is allowed (and then required) once the grammar accepts.

    Args:
        spec: the compiled grammar.
        tokenizer: a tokenizer or its :class:`TokenizerInfo` (for the matcher); not needed with ``matcher``.
        matcher: an llguidance matcher to continue from (``copy``).
    """

    def __init__(self, spec: GrammarSpec, tokenizer=None, *, matcher=None):
        self.spec = spec
        self.matcher = matcher if matcher is not None else new_matcher(spec, tokenizer)
        self.error = None
        self._done = False
        self._words = np.zeros(bitmask_words(spec.vocab_size), dtype=np.int32)
        self._end_step = Step(ALLOW, as_ids([spec.eos_token_id]), spec.eos_token_id)
        self._next: Step | None = None  # the mask of the current state, once computed
        self._expired = False  # its mask work was late (expire): the matcher is never touched again

    @property
    def end_token_id(self) -> int:
        return self.spec.eos_token_id

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def mask_due(self) -> bool:
        """The next :meth:`step` computes a mask (llguidance work: :class:`processors.mask_budget.MaskBudget`)."""
        return not self._done and self.error is None and self._next is None

    def expire(self, message: str) -> None:
        """End the row with ``message``: from now on only the end token, and the matcher is never used again (a
        worker thread may still be computing its mask: :mod:`processors.mask_budget`)."""
        if self.error is None:
            self.error = message
        self._expired = True

    def step(self) -> Step:
        if self._done or self.error is not None:
            return self._end_step
        if self.matcher.is_error():
            self.error = f"grammar error: {matcher_error(self.matcher)}"
            return self._end_step
        if self._next is None:
            words = np.empty_like(self._words)
            fill_bitmask(self.matcher, words)
            words.setflags(write=False)
            self._next = Step(BITMASK, words, self.spec.eos_token_id)
        return self._next

    def prime(self) -> None:
        """Compute the current mask now (the first one of a large grammar can take a second)."""
        self.step()

    def advance(self, token: int) -> None:
        self._next = None
        if self._done:
            return
        if token == self.spec.eos_token_id:
            self._done = True
            if self.error is None and not self.matcher.is_accepting() and not self.matcher.is_error():
                self.error = ENDED_EARLY
            return
        if self.error is not None:
            return
        if not 0 <= token < self.spec.vocab_size or not self.matcher.consume_token(token):
            # llguidance's message carries its whole parser state; the first line names the problem
            detail = matcher_error(self.matcher) if self.matcher.get_error() else "outside the vocabulary"
            self.error = f"token {token} rejected by the grammar: {detail}; forcing the end token"

    def copy(self) -> "GrammarCursor":
        # an expired cursor's matcher may still be in use by a worker thread: the copy shares it, never using it
        new = GrammarCursor(self.spec, matcher=self.matcher if self._expired else self.matcher.deep_copy())
        new.error = self.error
        new._done = self._done
        new._expired = self._expired
        return new

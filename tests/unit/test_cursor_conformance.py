"""Cursor conformance: every constraint kind against the ``processors.base.Cursor`` contract (``docs/design.md``,
"Constraint contract"). Kinds: tree, labels (single, multi), json, json_schema, regex, grammar (Lark), and the
``RowCursor`` chain
with and without think mode. Properties, each checked by seeded random walks over the kind's own allowed sets:
(a) allowed tokens advance cleanly, a token outside the set records an error and leaves only the end token;
(b) ``copy()`` is independent both ways; (c) a finished row allows only its end token and stays put; (d) the set
is never empty and ``apply_steps`` masks exactly what the ``Step`` says; (e) padded logits columns never survive;
(f) a finished walk is valid output; (g) ``prime()`` keeps the allowed set.

A walk takes a random allowed token or, more often as it grows, a "closing" one (end token, ``"``, ``}``, ...),
and early on sometimes ``{``/``[``, so it explores and still ends. Table kinds use the 35-token vocabulary of
``processors/testing.py``, grammar kinds the default model's tokenizer (fixture ``tokenizer``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

from processors.scenarios import load_scenario
from processors.kinds.tree.treefile.load import is_tree_path
from processors import (
    ALLOW, BAN, BITMASK, FREE, CompiledScenario, ConstrainedLogitsProcessor, GrammarCursor, LabelCursor, RowCursor,
    ThinkCursor, TreeCursor, apply_steps, bitmask_to_ids, build_label_tables, build_tree_tables, compile_json_schema,
    compile_regex, compile_scenario, compile_think, constraint_cursor,
)
from processors.kinds.grammar.kind import compile_lark
from processors.items import resolve_exclude
from processors.masks import mask_padded_vocab
from processors.testing import build_tokenizer, decode, tid, tree_data

TINY = build_tokenizer()
PAD_COLUMNS = 64

# -- the kinds ---------------------------------------------------------------------------------------------------

S, E = tid(":"), tid("}")  # tree root and end token (not the model's EOS)
NEW, YORK, CITY, SPORTS, TECH, NOLOGY, GT, AI, NLP = (
    tid(t) for t in (" New", " York", " City", " Sports", " Tech", "nology", " >", " AI", " NLP"))
TREE = {
    f"{S}": [NEW, SPORTS, TECH, AI],
    f"{S}_{NEW}": [YORK],
    f"{S}_{NEW}_{YORK}": [E, CITY, GT],  # the end token or a longer path
    f"{S}_{NEW}_{YORK}_{CITY}": [E],
    f"{S}_{NEW}_{YORK}_{GT}": [SPORTS, TECH],
    f"{S}_{NEW}_{YORK}_{GT}_{SPORTS}": [NEW, E],  # "..._{SPORTS}_{NEW}" is missing: only the end token
    f"{S}_{NEW}_{YORK}_{GT}_{TECH}": [NOLOGY],
    f"{S}_{NEW}_{YORK}_{GT}_{TECH}_{NOLOGY}": [E],
    f"{S}_{AI}": [NLP, E],
    f"{S}_{AI}_{NLP}": [E],
    f"{S}_{TECH}": [],  # an empty list, and "{S}_{SPORTS}" is missing: both allow only the end token
    f"{S}_{TECH}_{NOLOGY}": [E],  # unreachable
}
LABELS = ["New York", "New York City", "Sports", "Technology", "Technology > AI", "yes", "no"]
MAX_LABELS = 3
SCHEMA = {"type": "object", "required": ["name", "age", "kind"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8}, "ok": {"type": "boolean"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "kind": {"enum": ["x", "y"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
PATTERN = r"(cat|dog)s?-[0-9]{1,3}(\.[a-z]{2})?"
LARK = '''start: answer
answer: "yes" | "no" | NUMBER | "[" NUMBER ("," NUMBER)* "]"
NUMBER: /[0-9]{1,4}/
'''


@dataclass
class Kind:
    name: str
    tok: object
    make: Callable[[], object]  # a fresh cursor
    check: Callable[[list[int]], None]  # asserts that a finished walk's tokens are valid output
    closers: tuple[int, ...]  # tokens a walk prefers when allowed, in this order (the end token first)
    compiled: CompiledScenario | None = None  # for ConstrainedLogitsProcessor (None: no chain form)
    walks: int = 16
    openers: tuple[int, ...] = ()  # tokens a walk sometimes prefers early on (to nest JSON)

    @property
    def vocab(self) -> int:
        return len(self.tok)


def _compiled(kind, constraint, tok, think=None, start=None) -> CompiledScenario:
    return CompiledScenario(kind=kind, constraint=constraint, think=think, eos_token_ids=(tok.eos_token_id,),
                            vocab_size=len(tok), start_token_id=start)


def _answer(tokens, spec, stops) -> list[int]:
    """The tokens after the think block; asserts the block kept the think rules."""
    k = tokens.index(spec.end_ids[0])  # thinking ends at the first token of the end marker
    assert k <= spec.max_thinking_tokens, f"{k} thinking tokens, budget {spec.max_thinking_tokens}"
    assert not set(tokens[:k]) & set(stops), f"a stop token while thinking: {tokens[:k]}"
    assert tokens[k : k + len(spec.end_ids)] == list(spec.end_ids), f"end marker not whole: {tokens}"
    return tokens[k + len(spec.end_ids) :]


def _check_tree(tokens):
    assert is_tree_path({"start_token_id": S, "end_token_id": E, "sep": "_", "prefix_dict": TREE}, tokens), tokens


def _check_tree_items(tokens):
    _check_tree(tokens)
    # budget 5 (the end token may come after it: the engine stops the row there, on a whole item); two excluded
    assert len(tokens) - 1 <= 5 and tuple(tokens[:-1]) not in {(NEW, YORK), (AI,)}, tokens


def _check_label(tokens):
    assert tokens[-1] == TINY.eos_token_id and decode(TINY, tokens[:-1]) in {" " + x for x in LABELS}, tokens


def _check_labels(tokens):
    assert tokens[-1] == TINY.eos_token_id, tokens
    parts = decode(TINY, tokens[:-1]).split(",")
    assert all(p.startswith(" ") and p[1:] in LABELS for p in parts), parts
    assert len(set(parts)) == len(parts) and 1 <= len(parts) <= MAX_LABELS, parts


def _tiny_kinds() -> dict[str, Kind]:
    tok, eos = TINY, TINY.eos_token_id
    tree = build_tree_tables(tree_data(TREE, S, E), len(tok))
    single = build_label_tables(LABELS, tok, eos_token_id=eos, vocab_size=len(tok))
    multi = build_label_tables(LABELS, tok, eos_token_id=eos, vocab_size=len(tok), multi_label=True,
                               max_labels=MAX_LABELS)
    think = compile_think(3, "<think>\n", "</think>\n\n", tok)
    chain_tree = _compiled("tree", tree, tok, start=S)
    chain_multi = _compiled("labels", multi, tok, think=think)
    chain_free = _compiled("json", None, tok, think=think)
    excluded = resolve_exclude(tree, [[NEW, YORK], [AI]])

    def free_answer(tokens):
        answer = _answer(tokens, think, {eos})
        assert answer and answer[-1] == eos and eos not in answer[:-1], answer
        assert not {think.begin_ids[0], think.end_ids[0]} & set(answer), f"thinking reopened: {answer}"

    return {
        "tree": Kind("tree", tok, lambda: TreeCursor(tree), _check_tree, (E,), _compiled("tree", tree, tok, start=S)),
        "labels": Kind("labels", tok, lambda: constraint_cursor(single), _check_label, (eos,),
                       _compiled("labels", single, tok)),
        "labels_cursor": Kind("labels_cursor", tok, lambda: LabelCursor(single), _check_label, (eos,)),
        "multi_label": Kind("multi_label", tok, lambda: LabelCursor(multi), _check_labels, (eos,),
                            _compiled("labels", multi, tok)),
        "chain_tree": Kind("chain_tree", tok, lambda: RowCursor(chain_tree, tok), _check_tree, (E,), chain_tree),
        # item controls bound (processors.items): a token budget and an excluded item
        "tree_items": Kind("tree_items", tok, lambda: TreeCursor(tree).bind(budget=5, request=excluded),
                           _check_tree_items, (E,)),
        "chain_tree_budget": Kind("chain_tree_budget", tok, lambda: RowCursor(chain_tree, tok, max_new_tokens=4),
                                  _check_tree, (E,), chain_tree),
        "chain_multi_think": Kind("chain_multi_think", tok, lambda: RowCursor(chain_multi, tok),
                                  lambda t: _check_labels(_answer(t, think, {eos})), (eos,), chain_multi),
        "chain_free_think": Kind("chain_free_think", tok, lambda: RowCursor(chain_free, tok), free_answer, (eos,),
                                 chain_free),
    }


def _real_kinds(tok) -> dict[str, Kind]:
    import jsonschema

    eos = tok.eos_token_id
    closers = (eos,) + tuple(tok.encode(t, add_special_tokens=False)[0] for t in ('"', '}', ']', ":", "0"))
    any_json = compile_json_schema(None, tok, eos_token_id=eos)
    schema = compile_json_schema(SCHEMA, tok, eos_token_id=eos)
    regex = compile_regex(PATTERN, tok, eos_token_id=eos)
    chain = compile_scenario(load_scenario({"type": "json_schema", "schema": SCHEMA,
                                            "think": {"max_thinking_tokens": 4}}), tok)

    def text(tokens):
        assert tokens[-1] == eos and eos not in tokens[:-1], tokens
        return tok.decode(tokens[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def check_schema(tokens):
        jsonschema.validate(json.loads(text(tokens)), SCHEMA)

    def check_regex(tokens):
        assert re.fullmatch(PATTERN, text(tokens)), text(tokens)

    lark = pytest.importorskip("lark")
    lark_parser = lark.Lark(LARK)
    lark_spec = compile_lark(LARK, tok, eos_token_id=eos)

    def check_lark(tokens):
        lark_parser.parse(text(tokens))  # raises on an output outside the grammar

    openers = tuple(tok.encode(t, add_special_tokens=False)[0] for t in ("{", "["))
    grammars = [("json", any_json, lambda t: json.loads(text(t))), ("json_schema", schema, check_schema),
                ("regex", regex, check_regex), ("grammar", lark_spec, check_lark)]
    out = {name: Kind(name, tok, lambda spec=spec: GrammarCursor(spec, tok), check, closers,
                      _compiled(name, spec, tok), walks=6, openers=openers) for name, spec, check in grammars}
    out["chain_json_think"] = Kind("chain_json_think", tok, lambda: RowCursor(chain, tok),
                                   lambda t: check_schema(_answer(t, chain.think, {eos})), closers, chain, 6, openers)
    return out


TINY_KINDS = ["tree", "labels", "labels_cursor", "multi_label", "chain_tree", "chain_multi_think", "chain_free_think",
              "tree_items", "chain_tree_budget"]
REAL_KINDS = ["json", "json_schema", "regex", "grammar", "chain_json_think"]
ALL_KINDS = TINY_KINDS + REAL_KINDS
# LabelCursor without multi-label is not a chain kind; the processor form binds no item controls
WITH_PROCESSOR = [k for k in ALL_KINDS if k not in ("labels_cursor", "tree_items", "chain_tree_budget")]
WITH_PRIME = ["json", "json_schema", "regex", "grammar", "chain_tree", "chain_multi_think", "chain_free_think", "chain_json_think"]
THINKING = {"chain_multi_think", "chain_free_think", "chain_json_think"}
_BUILT: dict[str, Kind] = {}


@pytest.fixture
def kind(request) -> Kind:
    name = request.param
    if name not in _BUILT:
        _BUILT.update(_tiny_kinds() if name in TINY_KINDS else _real_kinds(request.getfixturevalue("tokenizer")))
    return _BUILT[name]


def kinds(names, xfail_thinking: str | None = None):
    """Parametrize ``kind``; with ``xfail_thinking``, the think kinds are strict expected failures (a known gap)."""
    params = [pytest.param(n, marks=pytest.mark.xfail(reason=xfail_thinking, strict=True))
              if xfail_thinking and n in THINKING else n for n in names]
    return pytest.mark.parametrize("kind", params, indirect=True)


# -- helpers -----------------------------------------------------------------------------------------------------
def allowed(cursor, vocab: int) -> np.ndarray:
    """The ids a uniform row keeps after ``apply_steps`` with the cursor's step (sorted)."""
    scores = torch.zeros(1, vocab)
    apply_steps(scores, [cursor.step()])
    return np.flatnonzero(torch.isfinite(scores[0]).numpy())


def step_ids(step, vocab: int) -> np.ndarray:
    """What a ``Step`` allows, read from the step itself (independently of ``apply_steps``)."""
    if step.kind == FREE:
        return np.arange(vocab)
    if step.kind == BAN:
        return np.setdiff1d(np.arange(vocab), np.asarray(step.payload))
    ids = np.asarray(step.payload) if step.kind == ALLOW else bitmask_to_ids(step.payload, vocab)
    return np.unique(ids) if ids.size else np.asarray([step.fallback])


def has(ids: np.ndarray, token: int) -> bool:
    i = int(np.searchsorted(ids, token))
    return i < ids.size and ids[i] == token


def state_of(c):
    """Everything that makes up a cursor's state (to see that nothing changes)."""
    if isinstance(c, RowCursor):
        return (c.done, c.generated, c.error, state_of(c.constraint) if c.constraint else None,
                state_of(c.think) if c.think else None)
    if isinstance(c, TreeCursor):
        return (c.state, c.fell_back, c.error)
    if isinstance(c, LabelCursor):
        return (c.state, c.sep_pos, c.count, c.error, tuple(c.emitted))
    if isinstance(c, GrammarCursor):
        return (c.finished, c.error, c.matcher.is_accepting(), c.matcher.is_error())
    if isinstance(c, ThinkCursor):
        return (c.phase, c.pos, c.thought, c.error)
    raise TypeError(type(c).__name__)


def walk(kind: Kind, seed: int, hook=None, max_steps: int = 300):
    """Drive a fresh cursor over its allowed sets until it finishes: ``(cursor, tokens, allowed sets)``.

    ``hook(cursor, allowed, rng)`` runs before each token is chosen (it must not advance ``cursor``). Every
    allowed token must advance without an error."""
    rng = np.random.default_rng(seed)
    cursor = kind.make()
    tokens: list[int] = []
    sets: list[np.ndarray] = []
    while not cursor.finished:
        if len(tokens) >= max_steps:
            pytest.fail(f"{kind.name} seed {seed}: not finished after {max_steps} tokens: {tokens}")
        ids = allowed(cursor, kind.vocab)
        sets.append(ids)
        if hook is not None:
            hook(cursor, ids, rng)
        closer = next((c for c in kind.closers if has(ids, c)), None)
        opener = next((c for c in rng.permutation(kind.openers) if has(ids, c)), None)
        p_close, r = min(0.8, len(tokens) / 16), rng.random()  # explore first, then wind down
        if closer is not None and r < p_close:
            token = closer
        elif opener is not None and len(tokens) < 10 and r > 0.7:
            token = int(opener)
        else:
            token = int(rng.choice(ids))
        cursor.advance(token)
        tokens.append(token)
        assert cursor.error is None, f"{kind.name} seed {seed}: token {token} after {tokens[:-1]}: {cursor.error}"
    return cursor, tokens, sets


# -- (a) allowed set and advance agree ---------------------------------------------------------------------------
@kinds(ALL_KINDS)
def test_every_allowed_token_advances_cleanly(kind):
    def hook(cursor, ids, rng):
        end = cursor.end_token_id
        stops = getattr(cursor, "stop_ids", {end})
        sample = set(rng.choice(ids, size=min(8, ids.size), replace=False).tolist())
        for token in sample | ({end} if has(ids, end) else set()):
            twin = cursor.copy()
            twin.advance(token)
            assert twin.error is None, f"allowed token {token}: {twin.error}"
            if token == end:
                assert twin.finished, f"the end token {end} was allowed but did not finish the row"
            elif token not in stops:
                assert not twin.finished, f"token {token} finished the row"

    for seed in range(kind.walks):
        walk(kind, seed, hook)


@kinds(ALL_KINDS)
def test_token_outside_the_allowed_set_falls_back_to_the_end_token(kind):
    checked = []

    def hook(cursor, ids, rng):
        outside = np.setdiff1d(np.arange(kind.vocab), ids, assume_unique=True)
        if not outside.size:
            return  # free text: nothing is outside
        end = cursor.end_token_id
        for token in {int(rng.choice(outside))} | ({end} if not has(ids, end) else set()):
            twin = cursor.copy()
            twin.advance(token)
            assert twin.error, f"token {token} outside the allowed set recorded no error"
            assert allowed(twin, kind.vocab).tolist() == [end], f"after token {token}: not only the end token"
            checked.append(token)

    for seed in range(kind.walks):
        walk(kind, seed, hook)
    assert checked, "no walk met a token outside its allowed set"


# -- (b) a copy is independent -----------------------------------------------------------------------------------
@kinds(ALL_KINDS)
def test_copy_is_independent_both_ways(kind):
    pending = []  # (copy, its allowed set) made before the original advanced

    def hook(cursor, ids, rng):
        for twin, before in pending:  # the original advanced since: the copies did not move
            assert np.array_equal(allowed(twin, kind.vocab), before) and twin.error is None
        pending.clear()
        twin = cursor.copy()
        assert np.array_equal(allowed(twin, kind.vocab), ids), "a copy does not start in the same state"
        for _ in range(2):  # advance the copy: the original does not move
            if not twin.finished:
                twin.advance(int(rng.choice(allowed(twin, kind.vocab))))
        assert np.array_equal(allowed(cursor, kind.vocab), ids) and cursor.error is None and not cursor.finished
        pending.append((cursor.copy(), ids))

    for seed in range(kind.walks):
        walk(kind, seed, hook)


# -- (c) finished rows -------------------------------------------------------------------------------------------
@kinds(ALL_KINDS)
def test_finished_row_allows_only_its_end_token_and_stays_put(kind):
    for seed in range(kind.walks):
        cursor, tokens, _ = walk(kind, seed)
        end = cursor.end_token_id
        assert tokens[-1] == end and allowed(cursor, kind.vocab).tolist() == [end]
        rng = np.random.default_rng(seed)
        before = state_of(cursor)
        for token in [end, *rng.integers(0, kind.vocab, 5).tolist(), *tokens]:
            cursor.advance(int(token))
            assert cursor.finished and state_of(cursor) == before, f"token {token} changed a finished row"
            assert allowed(cursor, kind.vocab).tolist() == [end]
        twin = cursor.copy()
        assert twin.finished and allowed(twin, kind.vocab).tolist() == [end]


# -- (d) never an empty set; the mask is the step ----------------------------------------------------------------
@kinds(ALL_KINDS)
def test_allowed_set_is_never_empty_and_is_what_the_step_says(kind):
    def hook(cursor, ids, rng):
        step = cursor.step()
        assert step.kind in (ALLOW, BITMASK, BAN, FREE)
        if step.kind in (ALLOW, BAN):
            payload = np.asarray(step.payload)
            assert payload.ndim == 1 and ((payload >= 0) & (payload < kind.vocab)).all(), payload
        assert ids.size >= 1, "nothing allowed"
        assert np.array_equal(ids, step_ids(step, kind.vocab)), "apply_steps kept other ids than the step allows"
        # the same rows in one batch, with random logits: each keeps exactly its set
        scores = torch.randn(3, kind.vocab, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        apply_steps(scores, [step, step, cursor.step()])
        for row in scores:
            assert np.array_equal(np.flatnonzero(torch.isfinite(row).numpy()), ids)

    for seed in range(kind.walks):
        walk(kind, seed, hook)


# -- (e) padded vocabulary ---------------------------------------------------------------------------------------
@kinds(ALL_KINDS)
def test_padded_logits_columns_are_never_allowed(kind):
    vocab = kind.vocab

    def hook(cursor, ids, rng):
        step = cursor.step()
        scores = torch.zeros(1, vocab + PAD_COLUMNS)
        scores[:, vocab:] = 1e3  # a padded column would win every sampler if it survived
        apply_steps(scores, [step])
        if step.kind in (ALLOW, BITMASK):  # a constraint's own set never reaches past the vocabulary
            assert not torch.isfinite(scores[0, vocab:]).any()
        mask_padded_vocab(scores, vocab)
        live = np.flatnonzero(torch.isfinite(scores[0]).numpy())
        assert np.array_equal(live, ids), "padded logits changed the allowed set"

    for seed in range(kind.walks):
        walk(kind, seed, hook)


@kinds(WITH_PROCESSOR)
def test_processor_masks_padding_and_agrees_with_the_cursor(kind):
    vocab = kind.vocab
    prompt = [0, 0]  # the cursors start after prompt_len; what the prompt holds does not matter to them
    for seed in range(min(kind.walks, 4)):
        _, tokens, sets = walk(kind, seed)
        proc = ConstrainedLogitsProcessor(kind.compiled, tokenizer=kind.tok, prompt_len=len(prompt))
        gen = torch.Generator().manual_seed(seed)
        for i, ids in enumerate(sets):
            raw = torch.randn(2, vocab + PAD_COLUMNS, generator=gen)
            raw[:, vocab:] = 1e3
            out = proc(torch.tensor([prompt + tokens[:i]] * 2), raw)
            assert not torch.isfinite(out[:, vocab:]).any(), f"step {i}: a padded id is allowed"
            for row in out:
                assert np.array_equal(np.flatnonzero(torch.isfinite(row).numpy()), ids), f"step {i}"
        assert proc.errors == [None, None]


# -- (f) a finished walk is valid output -------------------------------------------------------------------------
@kinds(ALL_KINDS)
def test_walk_to_the_end_is_valid_output(kind):
    outputs = set()
    for seed in range(kind.walks):
        cursor, tokens, _ = walk(kind, seed)
        assert cursor.error is None and tokens[-1] == cursor.end_token_id
        kind.check(tokens)
        outputs.add(tuple(tokens))
    assert len(outputs) > 1, "every walk took the same path: the walks do not explore"


# -- (g) prime -----------------------------------------------------------------------------------------------------
@kinds(WITH_PRIME)
def test_prime_does_not_change_the_allowed_set(kind):
    fresh, primed = kind.make(), kind.make()
    primed.prime()
    assert np.array_equal(allowed(primed, kind.vocab), allowed(fresh, kind.vocab))

    def hook(cursor, ids, rng):
        twin = cursor.copy()  # a grammar copy has no mask computed yet
        twin.prime()
        twin.prime()
        assert np.array_equal(allowed(twin, kind.vocab), ids)
        cursor.prime()
        assert np.array_equal(allowed(cursor, kind.vocab), ids) and cursor.error is None

    for seed in range(kind.walks):
        walk(kind, seed, hook)

"""Stop strings matched incrementally (``deployments/replica/answer.py``: IncrementalDecoder, TextWatch.feed; the replica's
``_Stops``) give exactly what the old whole-text form gave: decode every token's whole prefix, search all of it.

Real tokenizer of the default model; the reference below is the code the replica ran before (kept here verbatim
in spirit: full decode per token, wait on a trailing U+FFFD, ``text.find`` of every stop string, hold back the
longest tail that is a proper prefix of one)."""

from __future__ import annotations

import random

import pytest

from deployments.replica.answer import IncrementalDecoder, TextWatch, unsure_tail
from deployments.engines import FinishedEvent
from deployments.replica.stops import _Stops


def old_stream(tokenizer, ids: list[int], stops: list[str] | None):
    """The old streaming path: per token (piece sent, stopped), then the tokens kept and the final text."""
    stops = [s for s in stops or () if s]
    pieces, sent = [], ""
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            pieces.append("")
            continue
        if stops:
            cut = min((pos for pos in (full.find(s) for s in stops) if pos >= 0), default=-1)
            if cut >= 0:
                pieces.append(full[:cut][len(sent):])
                return pieces, n, full[:cut]
            visible = full[: len(full) - unsure_tail(full, stops)]
        else:
            visible = full
        pieces.append(visible[len(sent):])
        sent = visible
    return pieces, None, None


def new_stream(tokenizer, ids: list[int], stops: list[str] | None):
    watch = _Stops(tokenizer, stops)
    outputs: dict[int, FinishedEvent] = {}
    pieces, toks = [], []
    for n, token_id in enumerate(ids, 1):
        toks.append(token_id)
        piece = watch.piece(0, token_id, toks, outputs)
        pieces.append(piece or "")
        if 0 in outputs:
            assert outputs[0].token_ids == ids[:n] and outputs[0].finish_reason == "stop"
            return pieces, n, watch.final[0]
    return pieces, None, None


def new_blocking(tokenizer, ids: list[int], stops: list[str]):
    """The non-streaming path (``_Stops.token``): which token stopped it and the final text."""
    watch = _Stops(tokenizer, stops)
    outputs: dict[int, FinishedEvent] = {}
    for token_id in ids:
        watch.token(0, token_id, outputs)
    if 0 not in outputs:
        return None, None
    return len(outputs[0].token_ids), watch.final[0]


TEXTS = [
    "Hello world, this is a test of stop strings.\n\nSecond paragraph END here.",
    "héllo wörld 日本語 😀 and more 日本語 text ### done",
    "The answer is 42. Observation: nothing more to say. Observation: again",
    "abcabcabd xyz",
    "<|im_end|> is plain text here, not a special token",
]

CASES = [
    (0, ["\n\n"]),  # a stop of two tokens or one
    (0, ["o w"]),  # spans "Hello" and " world"
    (0, ["END", "Second"]),  # the earlier one wins
    (0, ["stop strings.\n\nSec"]),  # long, over many tokens
    (0, ["never there"]),  # no stop: every piece, held tails released
    (0, None),
    (1, ["本語"]),  # multi-byte characters, a stop inside a token's characters
    (1, ["😀"]),  # a character spread over several tokens
    (1, ["###", "ö"]),
    (2, ["Observation:"]),
    (2, [". O", "bs"]),  # overlapping candidates
    (3, ["abcabd"]),  # a false start before the match (tail kept across the near miss)
    (3, ["abd", "cab"]),
    (3, ["a"]),  # a stop in the first token: nothing is sent
    (4, ["<|im_end|>"]),  # encoded as the special token, which decodes to nothing: never seen
    (4, ["is plain"]),
]
NEVER = {"never there", "<|im_end|>"}


@pytest.mark.parametrize("text_index,stops", CASES)
def test_incremental_stops_match_the_whole_text_form(tokenizer, text_index, stops):
    ids = tokenizer.encode(TEXTS[text_index], add_special_tokens=False)
    expected = old_stream(tokenizer, ids, stops)
    assert new_stream(tokenizer, ids, stops) == expected
    if stops:
        assert new_blocking(tokenizer, ids, stops) == expected[1:]
    assert (expected[1] is not None) == bool(stops and stops[0] not in NEVER)  # the case stops or not, as meant


def test_a_stop_spanning_tokens_is_found_where_it_completes(tokenizer):
    ids = tokenizer.encode("Hello world, again", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "o w" not in "".join(p for p in pieces if "o w" in p)  # no single token holds it
    _, stopped_at, final = new_stream(tokenizer, ids, ["o w"])
    assert final == "Hell"
    assert stopped_at == next(n for n in range(1, len(ids) + 1) if "o w" in tokenizer.decode(ids[:n]))


def test_random_token_sequences_match(tokenizer):
    """Random ids (invalid UTF-8 midway, special tokens that decode to nothing) and stops cut from the text."""
    rng = random.Random(7)
    special = list(tokenizer.all_special_ids)
    for _ in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(max(1, len(full)))
            stops.append(full[start: start + rng.randrange(1, 12)] or "x")
        expected = old_stream(tokenizer, ids, stops)
        assert new_stream(tokenizer, ids, stops) == expected, (ids, stops)
        assert new_blocking(tokenizer, ids, stops) == expected[1:]
        assert new_stream(tokenizer, ids, None) == old_stream(tokenizer, ids, None)


def test_pieces_add_up_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXTS[1] + TEXTS[0], add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(p or "" for p in map(decoder.add, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_text_watch_feed_holds_only_an_unsure_tail():
    watch = TextWatch(["END", "\n\n"])
    assert [watch.feed(p) for p in ["abc E", "N", "X"]] == ["abc ", "", "ENX"]
    assert watch.feed("\n") == "" and not watch.stopped
    assert watch.feed("\nmore") == "" and watch.stopped and watch.text == "abc ENX"
    assert watch.feed("later") == ""

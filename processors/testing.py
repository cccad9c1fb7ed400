"""Hand-built vocabularies and a tiny decode driver, for tests of processors and of code built on them (no model).

:func:`build_tokenizer` returns a real HuggingFace fast tokenizer with 35 tokens: a Unigram model over
byte-level pieces (GPT-2 style ``Ġ`` for a space, ``Ċ`` for a newline) with the ByteLevel pre-tokenizer
(no regex split, so ``<think>`` is one token) and the ByteLevel decoder, so ``encode``/``decode`` round-trip
for every text the pieces cover. A character it has no piece for becomes ``<unk>`` (and does not round-trip).

:func:`tree_data` builds a ``processors.kinds.tree.treefile.load.TreeData``-like namespace from a prefix dict, and :func:`drive` runs a
processor the way ``generate`` does: call it, pick a token per row, append the column, repeat.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"

# the text of every regular piece, in id order after the three special tokens
PIECES = [
    " New", " York", " City", " Sports", " Tech", "nology", ",", " >", " AI", " NLP",
    "<think>", "</think>", "\n", "\n\n", " ", " yes", " no", "yes", "no",
    "y", "e", "s", "n", "o", "{", "}", '"', ":", "ok",
    " Politics", "!", "es",  # ids 32..34: the second bitmask word
]


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table used by the ByteLevel pre-tokenizer and decoder."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_B2U = _bytes_to_unicode()


def byte_level(text: str) -> str:
    return "".join(_B2U[b] for b in text.encode("utf-8"))


@functools.lru_cache(maxsize=None)
def build_tokenizer():
    """A 35-token ``PreTrainedTokenizerFast``: ids 0..2 are ``<pad>``, ``<unk>``, ``<eos>``; then :data:`PIECES`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [(PAD, 0.0), (UNK, 0.0), (EOS, 0.0)] + [(byte_level(p), -1.0) for p in PIECES]
    backend = Tokenizer(models.Unigram(pieces, unk_id=1, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    assert len(tok) == 3 + len(PIECES)
    return tok


def tid(text: str) -> int:
    """The id of the piece whose text is ``text``."""
    return 3 + PIECES.index(text)


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def tree_data(prefix_dict: dict[str, list[int]], start_token_id: int, end_token_id: int, sep: str = "_"):
    """A ``processors.kinds.tree.treefile.load.TreeData``-like object (keys in dict order, CSR offsets, candidates in file order)."""
    keys = list(prefix_dict)
    lens = [len(prefix_dict[k]) for k in keys]
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    cands = np.asarray([c for k in keys for c in prefix_dict[k]], dtype=np.int64)
    return types.SimpleNamespace(
        start_token_id=start_token_id, end_token_id=end_token_id, sep=sep, keys=keys, offsets=offsets, candidates=cands
    )


def allowed_ids(row: torch.Tensor) -> set[int]:
    """Ids whose logit is not -inf."""
    return set(torch.nonzero(~torch.isneginf(row)).flatten().tolist())


def sample(scores: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sample one token per row from softmax(scores) (uniform among the live ids for zero logits)."""
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=gen).flatten()


def greedy(scores: torch.Tensor, gen=None) -> torch.Tensor:
    return scores.argmax(dim=-1)


def drive(proc, input_ids, width: int, steps: int, pick=sample, *, seed: int = 0, logits=None, check=None):
    """Run ``proc`` for ``steps`` decode steps like ``generate`` would; return the full ids.

    ``logits(step, input_ids) -> scores`` makes the raw scores (default: zeros of ``width``); ``check(step,
    input_ids, raw, masked)`` is called after each masking, before the token is chosen. Every masked row is
    asserted to keep at least one live id.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = input_ids.clone()
    for step in range(steps):
        raw = logits(step, ids) if logits is not None else torch.zeros(ids.shape[0], width)
        masked = proc(ids, raw.clone())
        assert masked.shape == raw.shape
        assert bool((~torch.isneginf(masked)).any(dim=1).all()), f"a row is all -inf at step {step}"
        if check is not None:
            check(step, ids, raw, masked)
        nxt = pick(masked, gen)
        ids = torch.cat([ids, nxt[:, None].to(ids.dtype)], dim=1)
    return ids

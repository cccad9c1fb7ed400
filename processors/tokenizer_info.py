"""What the constraint code needs to know about a tokenizer, built once per tokenizer.

Everything below the model loader (compiling scenarios, cursors, logits processors, the grammar worker, the console's
replay) takes a :class:`TokenizerInfo` instead of the raw tokenizer: the vocabulary size, the model's EOS ids, the
width of the model's logits, the llguidance tokenizer (built on first use, about 0.4 s for a 49k vocabulary) and the
decoded bytes of each token. The HF tokenizer stays reachable as :attr:`TokenizerInfo.tokenizer` for what truly
needs it: the chat template and the encoding of prompts, labels and think markers.

:meth:`TokenizerInfo.of` shares the lazy parts of every info of one tokenizer object (cached per object, without
keeping it alive), so they are built once per process and tokenizer; convert once and pass the info on. Functions that took a tokenizer still take
one, or a ``TokenizerInfo``: they convert with :meth:`TokenizerInfo.of`, which returns an info unchanged.

Example::

    >>> info = TokenizerInfo.of(tokenizer)                 # doctest: +SKIP
    >>> info.vocab_size, info.eos_token_ids                # doctest: +SKIP
    (49152, (2,))
    >>> info.lltokenizer is TokenizerInfo.of(tokenizer).lltokenizer   # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TokenizerInfo", "hf_tokenizer"]

# tokenizer -> (vocab_size, eos ids, lazy parts). Not the info itself: it holds the tokenizer, and a value that
# refers to its key would keep the key alive forever.
_CACHE: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
_CACHE_BY_ID: dict[int, tuple] = {}  # tokenizers that cannot be weakly referenced (kept for the process)
_CACHE_LOCK = threading.Lock()


class _Lazy:
    """The parts built on first use, shared by every info derived from one tokenizer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lltokenizer: Any = None
        self.token_bytes: tuple[bytes, ...] | None = None


def _eos_ids(tokenizer, model_config=None) -> tuple[int, ...]:
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    extra = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(extra, int):
        extra = [extra]
    for t in extra or []:
        if int(t) not in ids:
            ids.append(int(t))
    return tuple(ids)


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """One tokenizer as the constraint code sees it. Immutable; the lazy parts are built once, thread-safely.

    Args:
        tokenizer: the HF tokenizer (chat template, encoding prompts and labels).
        vocab_size: ``len(tokenizer)``, added tokens included: ids are checked against it.
        eos_token_ids: the model's EOS ids, the tokenizer's first (plus a generation config's); may be empty.
        logits_width: columns of the model's logits when known; more than ``vocab_size`` for a padded vocabulary
            (Qwen: 151,936 logits for about 151,665 tokens). ``None``: the tokenizer's size.
    """

    tokenizer: Any = field(repr=False)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    logits_width: int | None = None
    _lazy: _Lazy = field(default_factory=_Lazy, repr=False)

    @classmethod
    def of(cls, source: Any, *, model_config: Any = None, logits_width: int | None = None) -> "TokenizerInfo":
        """The info of a tokenizer (sharing the lazy parts of every info of that tokenizer), or ``source``
        itself when it is one. ``model_config`` adds its ``eos_token_id``\\ s; ``logits_width`` sets the logits width
        (both give a new info sharing the lazy parts)."""
        info = source if isinstance(source, TokenizerInfo) else cls._cached(source)
        if model_config is not None:
            eos = _eos_ids(info.tokenizer, model_config)
            if eos != info.eos_token_ids:
                info = dataclasses.replace(info, eos_token_ids=eos, _lazy=info._lazy)
        if logits_width is not None and logits_width != info.logits_width:
            info = info.with_logits_width(logits_width)
        return info

    @classmethod
    def _cached(cls, tokenizer: Any) -> "TokenizerInfo":
        if tokenizer is None:
            raise TypeError("a tokenizer is required (a HF tokenizer or a TokenizerInfo), got None")
        try:
            core = _CACHE.get(tokenizer)
            weak = True
        except TypeError:  # not weak-referenceable (or not hashable)
            core, weak = _CACHE_BY_ID.get(id(tokenizer)), False
        if core is None:
            with _CACHE_LOCK:
                core = _CACHE.get(tokenizer) if weak else _CACHE_BY_ID.get(id(tokenizer))
                if core is None:
                    core = (len(tokenizer), _eos_ids(tokenizer), _Lazy())
                    if weak:
                        _CACHE[tokenizer] = core
                    else:
                        _CACHE_BY_ID[id(tokenizer)] = core
        vocab_size, eos, lazy = core
        return cls(tokenizer=tokenizer, vocab_size=vocab_size, eos_token_ids=eos, _lazy=lazy)

    def __reduce__(self):  # the lazy parts (a lock, a Rust object) are built again where it is unpickled
        return (TokenizerInfo, (self.tokenizer, self.vocab_size, self.eos_token_ids, self.logits_width))

    def with_logits_width(self, width: int) -> "TokenizerInfo":
        """This info for a model whose logits have ``width`` columns (at least :attr:`vocab_size`)."""
        if width < self.vocab_size:
            raise ValueError(f"logits_width {width} is below the vocabulary size {self.vocab_size}")
        return dataclasses.replace(self, logits_width=int(width), _lazy=self._lazy)

    @property
    def eos_token_id(self) -> int:
        """The first EOS id (what a constrained row ends with); ``ValueError`` when the tokenizer has none."""
        if not self.eos_token_ids:
            raise ValueError("the tokenizer has no eos_token_id; set one")
        return self.eos_token_ids[0]

    @property
    def lltokenizer(self):
        """The llguidance tokenizer (built on first use, once). Its EOS is the tokenizer's ``eos_token_id``:
        llguidance allows it once the grammar accepts."""
        lazy = self._lazy
        if lazy.lltokenizer is None:
            with lazy.lock:
                if lazy.lltokenizer is None:
                    import llguidance.hf

                    tok = self.tokenizer
                    lazy.lltokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab_size,
                                                                    eos_token=tok.eos_token_id)
        return lazy.lltokenizer

    @property
    def token_bytes(self) -> tuple[bytes, ...]:
        """The bytes of every token id, decoded alone (special tokens as their text); built on first use."""
        lazy = self._lazy
        if lazy.token_bytes is None:
            lltok = self.lltokenizer
            with lazy.lock:
                if lazy.token_bytes is None:
                    lazy.token_bytes = tuple(lltok.decode_bytes([i]) for i in range(self.vocab_size))
        return lazy.token_bytes

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens kept (``198`` -> ``"\\n"``), as the console shows it."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def hf_tokenizer(tokenizer_or_info: Any) -> Any:
    """The HF tokenizer of a :class:`TokenizerInfo`, or the argument itself."""
    return tokenizer_or_info.tokenizer if isinstance(tokenizer_or_info, TokenizerInfo) else tokenizer_or_info

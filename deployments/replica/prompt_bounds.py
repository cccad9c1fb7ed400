"""The prompt's length bound in bytes: a text that cannot fit in ``max_prompt_tokens`` tokens is
refused by its length, before it is tokenized.

No token of the tokenizer decodes to more than ``max_token_bytes`` bytes (the longest token of its vocabulary,
special tokens included), so a prompt of ``B`` bytes has at least ``ceil(B / max_token_bytes)`` tokens: a prompt of
more than ``max_prompt_tokens * max_token_bytes`` bytes can never fit, and is a 413 without being tokenized.
Tokenizing is linear but slow (a 20 MB text took about 7 s, on the replica's event loop, which then missed the
ingress's liveness pings); with the bound, at most ``max_prompt_tokens * max_token_bytes`` bytes (about 330 KB with
SmolLM2's tokenizer, whose longest token is 81 bytes, and the default 4,096 tokens) are ever tokenized.

The bound holds for a tokenizer that keeps every byte of the text in some token (byte-level BPE: GPT-2, Llama 3,
Qwen, SmolLM2; SentencePiece with byte fallback). A tokenizer that drops text (a normalizer that strips accents, an
unknown-token run) could fit a longer text: with such a tokenizer, a text over the bound is refused even when its
tokens would fit.
"""

from __future__ import annotations

from typing import Any

from ..protocol import ServiceError

__all__ = ["max_token_bytes", "prompt_too_long"]


def _byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        from tokenizers import decoders
    except ImportError:  # pragma: no cover - transformers' fast tokenizers come with tokenizers
        return False
    return isinstance(backend.decoder, decoders.ByteLevel)


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes any one token of ``tokenizer`` (a HF tokenizer or a ``TokenizerInfo``) decodes to.

    A byte-level BPE tokenizer writes each byte of a token as one character of its token string, so the longest
    token string is the longest token (added tokens, the special ones among them, count their text): a pass over
    the vocabulary, milliseconds. Any other tokenizer: each token decoded alone (``TokenizerInfo.token_bytes``,
    built once per process; about a second for a 49k vocabulary)."""
    from processors.tokenizer_info import TokenizerInfo, hf_tokenizer

    tok = hf_tokenizer(tokenizer)
    if _byte_level(tok):
        added = {int(i): str(getattr(t, "content", t)) for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()}
        longest = max((len(t.encode("utf-8")) for t in added.values()), default=1)
        for i, token in enumerate(tok.convert_ids_to_tokens(range(len(tok)))):
            if i not in added and token is not None:
                longest = max(longest, len(token))
        return max(1, longest)
    return max(1, max(len(b) for b in TokenizerInfo.of(tokenizer).token_bytes))


def prompt_too_long(text_bytes: int, limit: int, token_bytes: int) -> ServiceError:
    """The 413 for a prompt of ``text_bytes`` bytes that cannot fit in ``limit`` (``max_prompt_tokens``) tokens of at
    most ``token_bytes`` bytes each."""
    most = limit * token_bytes
    return ServiceError(
        413, f"prompt: {text_bytes} bytes of text cannot fit in the limit max_prompt_tokens={limit} (no token of this "
             f"model is longer than {token_bytes} bytes: at most {most} bytes fit)",
        {"field": "prompt", "limit_name": "max_prompt_tokens", "limit": limit, "max_prompt_bytes": most},
    )

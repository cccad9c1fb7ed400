"""How a compiled scenario reaches vLLM's worker process: one pickle file per scenario version.

The replica holds :class:`processors.CompiledScenario` objects (from the config manager, or compiled for a
one-off constraint); vLLM runs our logits processor in a worker process of its own, and per-request data
travels to it inside ``SamplingParams.extra_args`` (msgpack over ZMQ). A tree table can be megabytes, so the
request carries only ``{"key": compiled.version, "path": file}``: :class:`ScenarioFiles` writes each version
once (atomically: a temporary file renamed into place) into a private directory that is removed with the
engine, and :func:`load_compiled` reads it in the worker, which caches it by key.

Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading

__all__ = ["BUDGET_ENV", "EXTRA_KEY", "OWNER_ENV", "ScenarioFiles", "load_compiled", "owner_marker"]

#: the key of our entry in ``SamplingParams.extra_args``
EXTRA_KEY = "constrained_serve"
#: environment variable naming the replica process (``pid:start time``) to vLLM's processes (see .processor)
OWNER_ENV = "CONSTRAINED_SERVE_VLLM_OWNER"
#: ``mask_step_budget_ms`` for vLLM's worker (the replica sets it before starting vLLM; the worker inherits it)
BUDGET_ENV = "CONSTRAINED_SERVE_MASK_STEP_BUDGET_MS"


def owner_marker() -> str:
    """``pid:start time`` of this process (the start time tells a reused pid apart)."""
    import psutil

    return f"{os.getpid()}:{psutil.Process().create_time():.2f}"


class ScenarioFiles:
    """A private directory of pickled compiled scenarios, one file per version (content hash)."""

    def __init__(self, root: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="cs-vllm-scenarios-", dir=root)
        os.chmod(self.dir, 0o700)
        self._written: dict[str, str] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0

    def ref(self, compiled) -> dict[str, str]:
        """The ``extra_args`` entry for ``compiled``; writes its file the first time this version is seen."""
        key = compiled.version
        with self._lock:
            path = self._written.get(key)
            if path is None:
                path = os.path.join(self.dir, f"{key}.pkl")
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
                try:
                    with os.fdopen(fd, "wb") as f:
                        pickle.dump(compiled, f, protocol=pickle.HIGHEST_PROTOCOL)
                        self.bytes_written += f.tell()
                    os.replace(tmp, path)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
                self._written[key] = path
        return {"key": key, "path": path}

    def __len__(self) -> int:
        return len(self._written)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._written.clear()


def load_compiled(path: str, key: str):
    """Read a scenario written by :class:`ScenarioFiles` and check that it is the version asked for."""
    with open(path, "rb") as f:
        compiled = pickle.load(f)
    if getattr(compiled, "version", None) != key:
        raise ValueError(f"scenario file {os.path.basename(path)} holds version {getattr(compiled, 'version', None)!r}, "
                         f"expected {key!r}")
    return compiled

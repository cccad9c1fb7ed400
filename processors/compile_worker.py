"""Grammar compiles in a separate process, bounded in time and memory.

llguidance does the expensive part of a JSON-schema, regex or Lark grammar (its lexer: regexes, their
intersections and emptiness checks) when the grammar is validated, and the cost of that part is not
bounded by the grammar's size: ``{"type": "string", "allOf": [{"pattern": "a{1,}"}, ..., {"pattern":
"a{24,}"}]}`` (under 1 KB) takes 47 s and 4 GB, and each more pattern doubles both. A thread running it
cannot be stopped, and a failed allocation in Rust aborts the whole process. So that part runs here, in a
worker process started once (``python -P compile_worker.py``: stdlib and llguidance only, no torch, so it
starts in about half a second and stays warm), with

* a memory limit: its address space (``RLIMIT_AS``) is what it uses after start-up plus ``memory_mb``;
  past that an allocation fails and the worker dies or reports ``MemoryError``, not its parent;
* a wall-clock limit: the parent kills it ``timeout_s`` after sending a compile.

A killed or dead worker is replaced in the background, so the next compile does not pay the start.
The parent gets back the checked grammar string and builds the (cheap) :class:`GrammarSpec` itself.

This file is also the worker's program: run as a script it imports nothing from this project, so
nothing in ``processors/__init__`` (torch) is loaded there. The protocol on its stdin/stdout is one
JSON object per message, each preceded by its length (4 bytes, big-endian).
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

if __package__:  # imported as processors.compile_worker
    from . import schema_check
else:  # the worker program (python -P compile_worker.py): the sibling file alone, not the package (torch)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import schema_check  # type: ignore[no-redef]

__all__ = [
    "CompileCrashed",
    "CompileLimitError",
    "CompileMemoryExceeded",
    "CompileTimeout",
    "GrammarWorker",
    "build_grammar",
]

_HEADER = struct.Struct(">I")
_START_TIMEOUT_S = 120.0  # building the llguidance tokenizer takes ~0.3 s; a loaded 2-core machine is slower
_MEMORY_SIGNS = ("memory allocation of", "MemoryError", "Cannot allocate memory", "bad_alloc", "out of memory")


# ------------------------------------------------------------------------------------------ shared code


#: the source forms llguidance builds a grammar from (what a kind hands the worker; not kind names)
GRAMMAR_FORMS = ("json_schema", "regex", "lark")


def build_grammar(form: str, source: str, lltok, json_options: dict | None = None) -> tuple[str, list[str]]:
    """The checked llguidance grammar of ``source`` in one of llguidance's source forms (:data:`GRAMMAR_FORMS`):
    ``json_schema`` (the schema as JSON text), ``regex`` (the pattern) or ``lark`` (Lark text); and what it does not
    enforce.

    A JSON schema is compiled as its closest enforceable relaxation (:func:`schema_check.compile_relaxed`):
    the notes name each keyword removed or weakened (``not at #/properties/a``); empty for a regex, a Lark grammar
    or a schema enforced as written. Raises ``ValueError`` naming the problem. This is the step whose cost can
    explode; it runs in the worker process when a :class:`GrammarWorker` is used, in the caller's process otherwise.
    """
    if form not in GRAMMAR_FORMS:
        raise ValueError(f"unknown grammar form {form!r}; known: {', '.join(GRAMMAR_FORMS)}")
    if form != "json_schema":
        return _checked(form, source, lltok, None), []
    schema = json.loads(source)
    if not isinstance(schema, dict) or not schema:
        return _checked(form, source, lltok, json_options), []
    return schema_check.compile_relaxed(schema, lambda text: _checked(form, text, lltok, json_options))


def _checked(form: str, source: str, lltok, json_options: dict | None) -> str:
    import llguidance

    if form == "regex":
        try:
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"invalid regex {source!r}: {exc}") from exc
    elif form == "lark":  # llguidance checks it below
        grammar = llguidance.LLMatcher.grammar_from_lark(source)
    else:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=dict(json_options or {}))  # type: ignore[arg-type]
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error and form == "lark":
        raise ValueError(f"invalid Lark grammar: {messages[0].strip() if messages else 'unknown error'}")
    if form == "lark":
        _check_not_empty(grammar, lltok)
    if is_error:
        raise ValueError(f"invalid {form} constraint: {messages[0] if messages else 'unknown error'}")
    return grammar


def _check_not_empty(grammar: str, lltok) -> None:
    """A ``ValueError`` for a grammar whose first step allows no token (its language is empty: e.g. every rule
    needs itself first, ``x: x "a"``), found here rather than as an error on every row decoded under it."""
    import llguidance
    import numpy as np

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    words = np.zeros((lltok.vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if matcher.is_error() or not words.any():
        raise ValueError("invalid Lark grammar: no text is a sentence of it (its language is empty: a rule that "
                         "never ends, e.g. x: x \"a\", or nothing that start can begin with)")


def _send(fd: int, message: dict) -> None:
    data = json.dumps(message).encode("utf-8")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int, deadline: float | None = None) -> dict | None:
    """One message from ``fd``; ``None`` at end of file; ``TimeoutError`` past ``deadline`` (monotonic)."""
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    if body is None:
        return None
    return json.loads(body)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, size - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# ------------------------------------------------------------------------------------------ the parent side


class CompileLimitError(ValueError):
    """A grammar compile went past a limit; the message reads after "constraint" or "scenario 'x'".

    Attributes:
        limit_name: the ``Limits`` field (``compile_timeout_s``, ``compile_memory_mb``).
        limit: its value.
    """

    def __init__(self, message: str, limit_name: str, limit: float):
        super().__init__(message)
        self.limit_name, self.limit = limit_name, limit

    def __reduce__(self):
        return (type(self), (str(self), self.limit_name, self.limit))

    def detail(self) -> dict[str, Any]:
        return {"limit_name": self.limit_name, "limit": self.limit}


class CompileTimeout(CompileLimitError):
    """The compile ran past ``compile_timeout_s``; the worker was killed."""


class CompileMemoryExceeded(CompileLimitError):
    """The compile needed more than ``compile_memory_mb``; the worker failed to allocate and was replaced."""


class CompileCrashed(ValueError):
    """The worker process died during a compile for another reason (it is replaced)."""


def _tokenizer_source(tokenizer) -> tuple[str, int, int]:
    """What the worker needs to build the llguidance tokenizer (as ``llguidance.hf.from_tokenizer`` does)."""
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), len(tokenizer), int(tokenizer.eos_token_id)


class GrammarWorker:
    """A warm worker process that builds and checks grammars for one tokenizer, within limits.

    Args:
        tokenizer: a HF fast tokenizer or its ``TokenizerInfo`` (the worker gets the tokenizer's JSON form, not
            the object).
        timeout_s: a compile taking longer is killed (:class:`CompileTimeout`).
        memory_mb: the memory a compile may take above the worker's own after start-up
            (:class:`CompileMemoryExceeded`); ``None``: no limit.
        start: start the worker now (in a background thread) rather than at the first compile.

    Compiles are serialized (one worker). Thread-safe. :meth:`close` stops the worker; it also exits when
    its parent does.
    """

    def __init__(self, tokenizer, *, timeout_s: float, memory_mb: int | None, start: bool = True):
        from processors.tokenizer_info import hf_tokenizer  # the parent side only: the worker imports no project code

        tokenizer = hf_tokenizer(tokenizer)
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        try:
            self._tok_json, self.vocab_size, self.eos_token_id = _tokenizer_source(tokenizer)
            self._unusable: str | None = None
        except Exception as exc:  # not a HF fast tokenizer: llguidance cannot use it either
            self._tok_json, self.vocab_size, self.eos_token_id = "", len(tokenizer), -1
            self._unusable, start = f"grammars need a HF fast tokenizer ({type(exc).__name__}: {exc})", False
        self._cond = threading.Condition()
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None
        self._want = bool(start)  # the keeper should start a worker
        self._start_error: Exception | None = None
        self._keeper: threading.Thread | None = None
        self._closed = False
        self.starts = 0  # workers started so far
        self.start_s: float | None = None  # how long the last start took
        with self._cond:
            self._ensure_keeper()

    # -- lifecycle
    # Workers are started by one long-lived thread, the keeper: the worker asks the kernel to kill it when
    # the thread that started it exits (PR_SET_PDEATHSIG), which must therefore be a thread that lives as
    # long as this object.

    def _ensure_keeper(self) -> None:
        if self._keeper is None or not self._keeper.is_alive():
            self._closed = False
            self._keeper = threading.Thread(target=GrammarWorker._keep, args=(weakref.ref(self),),
                                            name="grammar-worker-keeper", daemon=True)
            self._keeper.start()

    @staticmethod
    def _keep(ref: "weakref.ref[GrammarWorker]") -> None:
        # Holds the worker object only while it works, so an unused GrammarWorker can be collected (its
        # __del__ kills the process; this thread then ends).
        while (self := ref()) is not None:
            cond = self._cond
            with cond:
                if self._closed:
                    return
                if self._want and self._proc is None:
                    self._want = False
                    try:
                        self._spawn()
                        self._start_error = None
                    except Exception as exc:  # reported to the compile waiting for it
                        self._start_error = exc
                    cond.notify_all()
                del self
                cond.wait(timeout=2.0)

    def _spawn(self) -> None:
        """Start the worker and wait until it is ready (keeper thread, lock held)."""
        t0 = time.monotonic()
        stderr = tempfile.TemporaryFile()
        env = dict(os.environ, MALLOC_ARENA_MAX="2", RAYON_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, close_fds=True,
        )
        self._proc, self._stderr = proc, stderr
        assert proc.stdin is not None and proc.stdout is not None  # PIPE
        try:
            _send(proc.stdin.fileno(), {"tokenizer": self._tok_json, "n_vocab": self.vocab_size,
                                        "eos": self.eos_token_id, "memory_mb": self.memory_mb})
            ready = _recv(proc.stdout.fileno(), time.monotonic() + _START_TIMEOUT_S)
        except (OSError, TimeoutError):
            ready = None
        if not ready or not ready.get("ready"):
            tail = self._stop()
            raise RuntimeError(f"the grammar compile worker did not start: {tail[-500:] or 'no output'}")
        self.starts += 1
        self.start_s = time.monotonic() - t0

    def _stop(self) -> str:
        """Kill the worker (lock held); the tail of its stderr."""
        proc, stderr = self._proc, self._stderr
        self._proc = self._stderr = None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not take this long
            pass
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        tail = ""
        if stderr is not None:
            try:
                stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 4096))
                tail = stderr.read().decode("utf-8", "replace").strip()
            finally:
                stderr.close()
        return tail

    def _replace(self) -> str:
        """Kill the worker and have the keeper start another in the background (lock held)."""
        tail = self._stop()
        self._want = True
        self._cond.notify_all()
        return tail

    def close(self) -> None:
        """Stop the worker and the keeper (a later compile starts them again)."""
        with self._cond:
            self._closed = True
            self._want = False
            self._stop()
            self._cond.notify_all()

    def __del__(self):  # pragma: no cover - best effort
        try:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
        except Exception:
            pass

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` while none runs)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> bool:
        """Wait until a worker runs (one is started if none is); whether it does."""
        with self._cond:
            return self._running(time.monotonic() + timeout)

    def _running(self, deadline: float) -> bool:
        self._ensure_keeper()
        if self._proc is not None and self._proc.poll() is None:
            return True
        self._stop()
        self._want, self._start_error = True, None
        self._cond.notify_all()
        self._cond.wait_for(lambda: self._proc is not None or self._start_error is not None,
                            max(0.0, deadline - time.monotonic()))
        return self._proc is not None

    # -- work

    def build(self, form: str, source: str, json_options: dict | None = None) -> tuple[str, list[str]]:
        """:func:`build_grammar` in the worker: the grammar string and its notes, or ``ValueError`` naming the problem
        (:class:`CompileTimeout`, :class:`CompileMemoryExceeded`, :class:`CompileCrashed` for the worker's own
        failures)."""
        if self._unusable is not None:
            raise ValueError(self._unusable)
        with self._cond:
            if not self._running(time.monotonic() + _START_TIMEOUT_S):
                raise RuntimeError(str(self._start_error or "the grammar compile worker did not start in time"))
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None  # _running() said so
            try:
                _send(proc.stdin.fileno(), {"form": form, "source": source, "json_options": json_options})
                reply = _recv(proc.stdout.fileno(), time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._replace()
                raise CompileTimeout(f"did not compile within {self.timeout_s:g} s "
                                     f"(limits.compile_timeout_s={self.timeout_s:g})",
                                     "compile_timeout_s", self.timeout_s) from None
            except OSError:  # BrokenPipeError: it died before reading the request
                reply = None
            if reply is None or reply.get("memory"):
                try:
                    code = proc.wait(timeout=5) if reply is None else None
                except subprocess.TimeoutExpired:
                    code = None
                tail = self._replace()
                if (reply is not None and reply.get("memory")) or any(s in tail for s in _MEMORY_SIGNS):
                    raise CompileMemoryExceeded(f"exceeded the compile memory limit "
                                                f"(limits.compile_memory_mb={self.memory_mb})",
                                                "compile_memory_mb", self.memory_mb or 0)
                how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                raise CompileCrashed(f"crashed the grammar compile process ({how})")
            if "error" in reply:
                raise ValueError(reply["error"])
            return reply["grammar"], list(reply.get("notes", []))


# ------------------------------------------------------------------------------------------ the worker side


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the worker still exits at EOF on stdin
        pass


def _worker_main() -> None:
    _die_with_parent()
    try:  # a long compile must not take CPU from decoding: the worker yields to the serving processes
        os.nice(10)
    except OSError:
        pass
    fd_in = sys.stdin.fileno()
    fd_out = os.dup(sys.stdout.fileno())  # the protocol's own descriptor; stray prints go to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    init = _recv(fd_in)
    if init is None:
        return
    import llguidance

    lltok = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    del init["tokenizer"]
    # Warm up (first-use allocations happen before the limit is measured).
    build_grammar("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]+"}}}',
                  lltok, {"whitespace_flexible": False})
    if init.get("memory_mb"):
        import resource

        limit = _vm_size() + int(init["memory_mb"]) * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    _send(fd_out, {"ready": True, "pid": os.getpid()})
    while True:
        request = _recv(fd_in)
        if request is None:
            return
        try:
            grammar, notes = build_grammar(request["form"], request["source"], lltok, request.get("json_options"))
            reply: dict[str, Any] = {"grammar": grammar, "notes": notes}
        except MemoryError:
            _send(fd_out, {"memory": True})
            return  # a failed allocation may have left anything half-built: start afresh
        except ValueError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # an engine error of another type: report it, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _send(fd_out, reply)


if __name__ == "__main__":
    _worker_main()

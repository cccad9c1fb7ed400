"""The scenario pipeline: parse -> limits -> compile, bounded in time, with a content-hash cache and one error
type.

Every path that turns a scenario body into a :class:`~processors.compile.CompiledScenario` goes through a
:class:`ScenarioCompiler`: the config manager (stored scenarios), the model replicas (one-off constraints from the
OpenAI routes), the console's inspect of an older version, and offline tools. The stages:

1. the body's shape, its limits (``processors.scenarios.check_limits``: the kind's own checks, then the nesting depth)
   and, for a one-off constraint, what only stored scenarios may use (a server file): before anything walks the
   body recursively (``processors.scenarios.check_scenario_body``);
2. validation into the kind's config model (``processors.scenarios.validate_scenario_body``);
3. compilation by the kind (:mod:`processors.registry`) for the compiler's tokenizer, JSON-schema and regex
   grammars in a :class:`~processors.compile_worker.GrammarWorker` killed at ``compile_timeout_s`` /
   ``compile_memory_mb``, then the limits that need the compiled form (the keys of a tree file); the whole of
   stages 2 and 3 bounded by ``compile_timeout_s`` on a worker thread, which is told to stop at that limit and
   unwinds at the table builders' next checkpoint (:mod:`config.cancel`).

Every failure is one :class:`config.ScenarioError` whose ``kind`` is ``invalid``, ``limit``, ``compile`` or
``timeout``; the message is the same wherever it happens, and only the HTTP edge chooses a status for it
(``deployments/scenario_errors.py``).

Like xgrammar's ``GrammarCompiler``, the compiler owns what compiles depend on: the tokenizer info, the limits,
the grammar worker and the cache.

Example::

    >>> compiler = ScenarioCompiler(tokenizer, Limits(), grammar_worker=None)          # doctest: +SKIP
    >>> compiled = compiler.prepare_now({"type": "labels", "labels": ["yes", "no"]})   # doctest: +SKIP
    >>> compiler.prepare_now({"type": "labels", "labels": []})                          # doctest: +SKIP
    Traceback (most recent call last):
    config.scenario_base.ScenarioError: labels: List should have at least 1 item after validation, not 0
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

from config import Limits, ScenarioError
from processors.scenarios import check_scenario_body, parse_scenario, validate_scenario_body
from config.settings import LimitExceeded

from . import registry
from .compile import CompiledScenario, compile_scenario
from config.cancel import CompileStopped, run_stoppable
from .compile_worker import CompileCrashed, CompileLimitError, CompileTimeout, GrammarWorker
from .tokenizer_info import TokenizerInfo

__all__ = ["ScenarioCache", "ScenarioCompiler", "ScenarioError"]

logger = logging.getLogger(__name__)


class ScenarioCache:
    """A thread-safe LRU of compiled scenarios (or refusals that would repeat), keyed by content hash."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._items: OrderedDict[str, CompiledScenario | ScenarioError] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> CompiledScenario | ScenarioError | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, item: CompiledScenario | ScenarioError) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class ScenarioCompiler:
    """Parse, check and compile scenario bodies for one tokenizer, the same way on every path.

    Args:
        tokenizer: the served model's tokenizer, or its :class:`TokenizerInfo`.
        limits: the ``config.Limits`` to apply (``compile_timeout_s`` and ``compile_memory_mb`` included).
        grammar_worker: ``True``: a :class:`GrammarWorker` of its own, bounded by ``limits`` (started now);
            a ``GrammarWorker`` to use; ``None``: grammars are built in this process, unbounded (offline tools).
        cache_size: one-off bodies kept compiled, by content hash (0: none). Stored scenarios are not cached: a
            tree given by ``path`` names a file, and the manager keeps large tables out of its own memory.
        executor: the threads :meth:`prepare_blocking` runs compiles on (default: two threads of its own);
            :meth:`prepare` uses asyncio's default executor unless given one.
    """

    def __init__(self, tokenizer: Any, limits: Limits | None = None, *, grammar_worker: GrammarWorker | bool | None = True,
                 cache_size: int = 0, executor: Executor | None = None):
        self.info = TokenizerInfo.of(tokenizer)
        self.limits = limits if limits is not None else Limits()
        self._owns_worker = grammar_worker is True
        if grammar_worker is True:
            grammar_worker = GrammarWorker(self.info, timeout_s=self.limits.compile_timeout_s,
                                           memory_mb=self.limits.compile_memory_mb)
        self.grammar_worker: GrammarWorker | None = grammar_worker or None
        self.cache = ScenarioCache(cache_size) if cache_size else None
        self._executor = executor
        self._own_pool: ThreadPoolExecutor | None = None
        #: The futures of the compiles given up on most recently (tests wait on them to see how they ended).
        self.abandoned: deque[Future] = deque(maxlen=8)

    # -- the stages -------------------------------------------------------------------------------------------

    def parse(self, body: Any, *, one_off: bool = False, field: str = "body", from_json: bool = False):
        """Stages 1 and 2: the body's config model (``processors.scenarios.parse_scenario`` with these limits; ``from_json``: the
        body was parsed from JSON text, no need to check that it serializes)."""
        return parse_scenario(body, self.limits, one_off=one_off, field=field, from_json=from_json)

    def compile_now(self, scenario, *, prebuilt: Any = None) -> CompiledScenario:
        """Stage 3 in this thread: compile a validated scenario, then the limits of the compiled form
        (``prebuilt``: see :func:`~processors.compile.compile_scenario`).

        Raises:
            ScenarioError: ``compile`` (does not compile, past ``compile_memory_mb``, the worker crashed),
                ``timeout`` (the grammar worker ran past ``compile_timeout_s``) or ``limit``.
        """
        try:
            compiled = compile_scenario(scenario, self.info, grammar_worker=self.grammar_worker, prebuilt=prebuilt)
            registry.get(scenario.type).check_compiled(scenario, compiled.constraint, self.limits)
        except (ScenarioError, CompileStopped):
            raise
        except LimitExceeded as exc:
            raise ScenarioError("limit", str(exc), field=exc.field, reason=exc.reason, detail=exc.detail()) from None
        except CompileTimeout as exc:  # "did not compile within 60 s (limits.compile_timeout_s=60)"
            raise ScenarioError("timeout", str(exc), detail=exc.detail()) from None
        except CompileLimitError as exc:  # "exceeded the compile memory limit (limits.compile_memory_mb=1024)"
            raise ScenarioError("compile", str(exc), detail=exc.detail()) from None
        except CompileCrashed as exc:
            raise ScenarioError("compile", str(exc)) from None
        except (ValueError, OSError) as exc:  # TreeFileError is a ValueError
            raise ScenarioError("compile", f"does not compile for the served tokenizer: {exc}") from None
        except Exception as exc:  # a grammar engine may raise other types on a bad pattern
            logger.warning("compiling a %s scenario failed", getattr(scenario, "type", "?"), exc_info=True)
            raise ScenarioError("compile", f"does not compile: {type(exc).__name__}: {exc}") from None
        return compiled

    def prepare_now(self, body: Any, *, one_off: bool = False, field: str = "body") -> CompiledScenario:
        """All stages in this thread, without the time bound of the compile threads (the grammar worker's
        still applies) and without the cache: for offline tools and code already on a bounded thread."""
        return self.compile_now(self.parse(body, one_off=one_off, field=field))

    # -- bounded, cached --------------------------------------------------------------------------------------

    def timeout_error(self) -> ScenarioError:
        """The error of a compile that ran past ``limits.compile_timeout_s``."""
        timeout = self.limits.compile_timeout_s
        return ScenarioError("timeout", f"did not compile within {timeout:g} s (limits.compile_timeout_s={timeout:g})",
                             detail={"limit_name": "compile_timeout_s", "limit": timeout})

    async def run_bounded(self, fn: Callable[..., Any], *args: Any, executor: Executor | None = None) -> Any:
        """``fn(*args)`` on a worker thread, awaited at most ``compile_timeout_s`` (then :meth:`timeout_error`).
        Past the limit the thread is told to stop (:mod:`config.cancel`): the table builders unwind at their
        next checkpoint, so a timed-out compile does not keep a core, its memory or the next compile's turn."""
        stop, outcome, call = _stoppable(fn, args)
        future = asyncio.get_running_loop().run_in_executor(executor if executor is not None else self._executor, call)
        try:
            async with asyncio.timeout(self.limits.compile_timeout_s) as deadline:
                return await future
        except TimeoutError:
            if deadline.expired():
                self._abandon(stop, outcome)
                raise self.timeout_error() from None
            raise

    def run_bounded_blocking(self, fn: Callable[..., Any], *args: Any, executor: Executor | None = None) -> Any:
        """:meth:`run_bounded` for a caller without an event loop (it waits)."""
        stop, outcome, call = _stoppable(fn, args)
        future = (executor or self._executor or self._pool()).submit(call)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except TimeoutError:
            if not future.done():
                future.cancel()  # still queued: it never starts
                self._abandon(stop, outcome)
                raise self.timeout_error() from None
            raise

    def _abandon(self, stop: threading.Event, future: Future) -> None:
        """Tell a compile past its limit to stop, and log how it ended (nobody else reads its result)."""
        stop.set()
        self.abandoned.append(future)

        def ended(done: Future) -> None:
            exc = None if done.cancelled() else done.exception()
            if isinstance(exc, CompileStopped):
                logger.info("a compile past compile_timeout_s stopped at a checkpoint")
            elif exc is not None:
                logger.info("a compile past compile_timeout_s ended with %s: %s", type(exc).__name__, exc)
            else:
                logger.warning("a compile past compile_timeout_s finished anyway (no checkpoint reached)")

        future.add_done_callback(ended)

    async def prepare(self, body: Any, *, one_off: bool = False, field: str = "body",
                      executor: Executor | None = None) -> CompiledScenario:
        """All stages: the cheap checks here, then validation and compilation on a worker thread bounded by
        ``compile_timeout_s``. A one-off body is looked up in the cache first; a refusal that would only repeat
        (past ``compile_memory_mb``) is cached too, so the same body is refused again without a compile."""
        key, prepared = self._check(body, one_off=one_off, field=field)
        hit = self._lookup(key)
        if hit is not None:
            return hit
        try:
            compiled = await self.run_bounded(self._validate_and_compile, body, prepared, executor=executor)
        except ScenarioError as exc:
            self._remember(key, exc)
            raise
        self._remember(key, compiled)
        return compiled

    def prepare_blocking(self, body: Any, *, one_off: bool = False, field: str = "body",
                         executor: Executor | None = None) -> CompiledScenario:
        """:meth:`prepare` for a caller without an event loop."""
        key, prepared = self._check(body, one_off=one_off, field=field)
        hit = self._lookup(key)
        if hit is not None:
            return hit
        try:
            compiled = self.run_bounded_blocking(self._validate_and_compile, body, prepared,
                                                 executor=executor)
        except ScenarioError as exc:
            self._remember(key, exc)
            raise
        self._remember(key, compiled)
        return compiled

    def _check(self, body: Any, *, one_off: bool, field: str) -> tuple[str | None, Any]:
        """Stage 1: the cache key of a one-off body (None when not cached) and what the checks built for the
        validation (:func:`~processors.scenarios.check_scenario_body`). Also refuses a body that is not JSON."""
        prepared = check_scenario_body(body, self.limits, one_off=one_off, field=field)
        cached = one_off and self.cache is not None
        try:
            text = json.dumps(body, sort_keys=cached, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ScenarioError("invalid", f"the scenario body is not JSON: {exc}") from None
        return (self.cache_key(text) if cached else None), prepared

    def cache_key(self, canonical_json: str) -> str:
        """The content hash of a body (its JSON with sorted keys) for this compiler's tokenizer."""
        info = self.info
        digest = hashlib.sha256(f"{info.vocab_size}:{info.eos_token_ids}\0".encode())
        digest.update(canonical_json.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def _validate_and_compile(self, body: Mapping[str, Any], prepared: Any = None) -> CompiledScenario:
        return self.compile_now(validate_scenario_body(body, prepared))

    def _lookup(self, key: str | None) -> CompiledScenario | None:
        """The cached compile of a body (None: not cached); raises the cached refusal."""
        hit = self.cache.get(key) if key is not None and self.cache is not None else None
        if isinstance(hit, ScenarioError):
            raise hit.with_traceback(None)
        return hit

    def _remember(self, key: str | None, item: CompiledScenario | ScenarioError) -> None:
        """Cache a compile, or a refusal that would repeat (past ``compile_memory_mb``: deterministic)."""
        if key is None or self.cache is None:
            return
        if isinstance(item, ScenarioError) and item.detail.get("limit_name") != "compile_memory_mb":
            return
        self.cache.put(key, item)

    def _pool(self) -> ThreadPoolExecutor:
        if self._own_pool is None:
            self._own_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="scenario-compile")
        return self._own_pool

    def close(self) -> None:
        """Stop the grammar worker this compiler started, and its own threads."""
        if self._owns_worker and self.grammar_worker is not None:
            self.grammar_worker.close()
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=False)


def _stoppable(fn: Callable[..., Any], args: tuple) -> tuple[threading.Event, Future, Callable[[], Any]]:
    """For a bounded run of ``fn(*args)``: its stop event, a future of how the call itself ended (an awaiting
    future is cancelled at the timeout, the thread goes on), and the callable for the worker thread (in a copy of
    the caller's context, inside :func:`~config.cancel.stop_scope`)."""
    stop = threading.Event()
    outcome: Future = Future()
    context = contextvars.copy_context()

    def call() -> Any:
        try:
            result = context.run(run_stoppable, stop, fn, *args)
        except BaseException as exc:
            outcome.set_exception(exc)
            raise
        outcome.set_result(result)
        return result

    return stop, outcome, call

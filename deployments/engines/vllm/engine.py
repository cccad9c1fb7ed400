"""The vLLM backend: vLLM's V1 engine in processes of its own, our processor chain inside it.

:class:`VLLMEngine` implements :class:`~deployments.engines.protocol.Engine` over vLLM's ``AsyncLLM``. vLLM
runs its engine core (scheduler, KV cache) in a child process of the replica and the model in a worker
process under it; the replica's process keeps only the client side and an asyncio loop on a thread of its
own ("the engine's thread": every event callback runs there).

One :class:`EngineRequest` becomes one vLLM request per output row (``n`` rows: ``n`` requests, row ``i``
seeded with ``seed + i`` as in the transformers backend; prefix caching shares the prompt). Each row of a
constrained request carries ``extra_args[EXTRA_KEY] = {"key", "path"}`` naming its pinned
:class:`processors.CompiledScenario` (:mod:`.handoff`); :class:`.processor.ChainLogitsProcessor` masks it in
vLLM's batch with the same :class:`processors.RowCursor` the transformers backend uses, so think gating,
trees with their own end token, labels, grammars and the finished-row rule behave the same. Stops are ours
alone: ``ignore_eos`` and ``stop_token_ids`` = the scenario's stop tokens (tree end token first) or the
tokenizer's EOS for free text.

The replica also replays every row's tokens through a cursor of its own (``advance`` only; no grammar
masks are computed here): that gives each output's ``error`` and ``fell_back`` exactly as the transformers
backend reports them, and a row whose cursor raises finishes with ``error``.

Item controls (``exclude``, ``distinct``; the token budget and a scenario's multi-item rules bind every tree and
label row): the request's :class:`processors.items.ItemRequest` travels as plain data in each row's entry
(:func:`.params.item_extra`, keyed by this request's id); the worker builds one book per request, shared by its
rows (:mod:`.item_groups`). The replica's replay cursor gets the exclusions (not the shared book: it replays each
row on its own).

Grammar rows (json / json_schema / regex) without think mode may instead go to vLLM's own structured
outputs with the ``guidance`` backend (``grammar_backend="guidance"``): the same llguidance grammar string
(compact whitespace, compiled by our compile step), so the same outputs are allowed; see the README for the
measured choice.

Rows go into vLLM at most ``max_batch_size`` at a time, the waiting requests offered room one client at a time
(:mod:`.fair_gate`): vLLM's own scheduler serves arrival order, so one client's burst would otherwise queue every
other client behind it.

Beam search is refused (:class:`UnsupportedRequest`, HTTP 400 naming the transformers backend and the setting
``beam_replicas``, with which the ingress sends beam requests to transformers-engine replicas of the same app
instead): vLLM's beam search is a client-side loop over single-token requests, one engine round trip per token and
beam, and its ranking is not the transformers backend's (see docs/engines.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, cast

from processors import RowCursor
from processors.grammar import ENDED_EARLY
from processors.items import ItemRequest

from ...protocol import ServiceError
from ..protocol import (
    DoneEvent, Engine, EngineEvent, EngineRequest, ErrorEvent, FinishedEvent, RequestTicket, TokenEvent,
)
from .fair_gate import FairGate
from .handoff import BUDGET_ENV, EXTRA_KEY, OWNER_ENV, ScenarioFiles, owner_marker
from .params import _token_logprobs, guidance_params, item_extra  # noqa: F401  (_token_logprobs: tests import it here)

logger = logging.getLogger(__name__)

__all__ = ["UnsupportedRequest", "VLLMEngine", "model_directory", "write_model_cache"]

GIB = 1 << 30
#: vLLM's largest temperature; above it the logits processor scales the logits (see .processor)
MAX_VLLM_TEMPERATURE = 2.0


class UnsupportedRequest(ServiceError, ValueError):
    """A request this backend does not run (a 4xx for the client, a ``ValueError`` for the engine contract)."""

    def __init__(self, message: str, detail: dict | None = None):
        ServiceError.__init__(self, 400, message, detail)


def model_directory(model_setting: str | None) -> str:
    """The checkpoint directory vLLM loads for the ``model`` setting.

    A checkpoint directory is used as is; a GGUF model (the default) uses the float32 checkpoint that
    :mod:`deployments.model_loader` caches. When that cache entry is missing it is written by a child process
    (:func:`write_model_cache`), so the calling replica never holds the model's weights: with ``engine: vllm``
    the weights live in vLLM's worker alone and the replica loads only the tokenizer.
    """
    from ...model_loader import _read_manifest, gguf_cache_dir, resolve_model

    source = resolve_model(model_setting)
    if source.kind == "checkpoint":
        return source.directory
    entry = gguf_cache_dir(source)
    if _read_manifest(entry, source) is None:
        detail = write_model_cache(model_setting)
        if _read_manifest(entry, source) is None:
            raise RuntimeError("the vllm engine needs the de-quantized checkpoint of the GGUF model, and the model "
                               f"cache could not be written (CONSTRAINED_SERVE_CACHE sets its place): {detail}")
    return str(entry)


#: the child process of :func:`write_model_cache`: load the model once (which writes its cache entry) and exit
_WRITE_CACHE = "import sys; from deployments.model_loader import load_model; load_model(sys.argv[1] or None)"


def write_model_cache(model_setting: str | None, timeout: float = 1800.0) -> str:
    """Write the float32 cache entry of a GGUF model in a child Python process (de-quantizing takes about 15 s and
    about 1 GB for the default model, returned to the system when the child exits). Returns the child's last
    output lines (for an error message); the caller checks the entry."""
    import subprocess
    import sys

    logger.info("writing the model cache of %s in a child process", model_setting or "the default model")
    start = time.perf_counter()
    try:
        # this checkout first on the child's path (a replica may run elsewhere than the project's directory)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run([sys.executable, "-c", _WRITE_CACHE, model_setting or ""], capture_output=True,
                              text=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return repr(exc)
    tail = "\n".join((done.stderr or "").strip().splitlines()[-5:])
    if done.returncode:
        logger.warning("writing the model cache failed (exit %s): %s", done.returncode, tail)
    else:
        logger.info("model cache written in %.1f s", time.perf_counter() - start)
    return f"exit {done.returncode}: {tail}"


class _Job(RequestTicket):
    """One submitted request: its rows' tasks on the engine loop and its cancel flag."""

    def __init__(self, engine: "VLLMEngine", request: EngineRequest, on_event: Callable[[EngineEvent], None]):
        self.engine = engine
        self.request = request
        self._on_event = on_event
        self.id = uuid.uuid4().hex
        self.cancelled = threading.Event()
        self.tasks: list[asyncio.Task] = []
        self.ended = False

    def emit(self, event: EngineEvent) -> None:
        if self.ended:
            return
        if isinstance(event, (DoneEvent, ErrorEvent)):
            self.ended = True
        try:
            self._on_event(event)
        except Exception:  # a consumer's failure must not stop the other rows
            logger.exception("an event callback failed")

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        loop = self.engine._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_tasks)

    def _cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()  # AsyncLLM.generate aborts its request when cancelled


class VLLMEngine(Engine):
    """vLLM's ``AsyncLLM`` behind the engine contract (see the module docstring).

    Args:
        model_dir: a HuggingFace checkpoint directory (see :func:`model_directory`).
        tokenizer: the replica's tokenizer (the same files): EOS ids and the replica's replay cursors.
        max_batch_size: rows one client's requests may have in vLLM together; vLLM's ``max_num_seqs`` is a quarter
            more, kept for clients with no row in (:mod:`.fair_gate`).
        max_model_len: longest prompt + output, in tokens.
        kv_cache_gb: KV cache size (GiB).
        enforce_eager: run the model eagerly (no torch.compile: a faster start, fewer tokens/s).
        dtype: the model's dtype in vLLM (``float32`` matches the transformers backend).
        grammar_backend: ``chain`` (our cursors in the logits processor) or ``guidance`` (vLLM's structured
            outputs, for grammar rows without think mode).
        cpu_threads: on CPU, threads of vLLM's model worker, bound to cores ``0..cpu_threads-1`` (``None``:
            vLLM's choice, the cores of one NUMA node but one).
        mask_step_budget_ms: the CPU time one row's grammar mask may take in one step of vLLM's worker (0: no
            budget); a row over it is ended there (its end token) and finishes with ``"error"`` naming the setting.
        engine_kwargs: more ``AsyncEngineArgs`` fields.
    """

    name = "vllm"
    reports_logprobs = True
    item_filters = True  # resolved again in the worker, on its copy of the version (.params.resolve_filter)

    def __init__(
        self, model_dir: str, tokenizer, *, max_batch_size: int = 16, max_model_len: int = 4096,
        kv_cache_gb: float = 2.0, enforce_eager: bool = False, dtype: str = "float32",
        grammar_backend: str = "chain", cpu_threads: int | None = None, mask_step_budget_ms: float = 200.0,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if grammar_backend not in ("chain", "guidance"):
            raise ValueError(f"grammar_backend must be 'chain' or 'guidance', got {grammar_backend!r}")
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.eos_token_ids = (int(tokenizer.eos_token_id),)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.enforce_eager = enforce_eager
        self.dtype = dtype
        self.grammar_backend = grammar_backend
        self.cpu_threads = cpu_threads
        self.mask_step_budget_ms = float(mask_step_budget_ms)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._files: ScenarioFiles | None = None
        self._active = 0
        self._start_lock = threading.Lock()
        # rows into vLLM, one client at a time, a quarter more kept for clients with none in (see .fair_gate)
        self._gate = FairGate(max_batch_size, reserve=max(1, max_batch_size // 4))
        self._stats = {
            "requests": 0, "rows": 0, "tokens": 0, "cancelled_jobs": 0, "failed_rows": 0, "fallback_rows": 0,
            "guidance_rows": 0, "failed_jobs": 0, "start_seconds": 0.0,
        }

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "VLLMEngine":
        with self._start_lock:
            if self.llm is not None:
                return self
            t0 = time.perf_counter()
            self._files = ScenarioFiles()
            if self.cpu_threads:  # read by vLLM's CPU worker (inherited by the processes it spawns)
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.cpu_threads - 1}"
            # vLLM's processes end themselves when this process dies without stopping them (see .processor)
            os.environ[OWNER_ENV] = owner_marker()
            os.environ[BUDGET_ENV] = repr(self.mask_step_budget_ms)  # the worker's MaskBudget (see .processor)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
            self._thread.start()
            try:
                asyncio.run_coroutine_threadsafe(self._create(), self._loop).result()
            except BaseException:
                self.stop()
                raise
            self._stats["start_seconds"] = round(time.perf_counter() - t0, 1)
            logger.info("vllm engine started in %.1f s (%s)", self._stats["start_seconds"], self.model_dir)
        return self

    def engine_args(self):
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        from .processor import FQCN

        kwargs: dict[str, Any] = dict(
            model=self.model_dir, tokenizer=self.model_dir, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self._gate.capacity + self._gate.reserve, kv_cache_memory_bytes=int(self.kv_cache_gb * GIB),
            enforce_eager=self.enforce_eager, logits_processors=[FQCN], enable_prefix_caching=True,
            # our processor reads each row's output tokens as they are: no placeholders of async scheduling
            async_scheduling=False, disable_log_stats=True, seed=0,
            structured_outputs_config=StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
            # logprobs of the distribution each token was sampled from: after our processor's mask (and vLLM's
            # structured outputs), temperature, top-k and top-p; as many alternatives as the API allows
            logprobs_mode="processed_logprobs", max_logprobs=20,
        )
        kwargs.update(self.engine_kwargs)
        return AsyncEngineArgs(**kwargs)

    async def _create(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(self.engine_args())

    def stop(self, timeout: float = 10.0) -> None:
        llm, self.llm = self.llm, None
        loop, self._loop = self._loop, None
        if loop is not None and loop.is_running():
            try:  # on the loop: vLLM's output handler is a task there
                asyncio.run_coroutine_threadsafe(self._shutdown(llm), loop).result(timeout + 30)
            except Exception:  # pragma: no cover
                logger.warning("vllm shutdown failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
        elif llm is not None:
            llm.shutdown()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._files is not None:
            self._files.close()
            self._files = None

    @staticmethod
    async def _shutdown(llm) -> None:
        if llm is not None:
            llm.shutdown()
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: EngineRequest, on_event: Callable[[EngineEvent], None]) -> _Job:
        if not isinstance(request, EngineRequest):
            raise TypeError(f"expected an EngineRequest, got {type(request).__name__}")
        if request.num_beams > 1:
            raise UnsupportedRequest(
                "num_beams > 1 (beam search) is not supported by the vllm engine backend; send num_beams 1, set "
                "beam_replicas (transformers-engine replicas in the same app that beam requests go to), or use a "
                "deployment with the transformers engine backend (setting engine: transformers)",
                {"field": "num_beams", "engine": "vllm", "supported_by": "transformers", "setting": "beam_replicas"},
            )
        if self.llm is None or self._loop is None:
            raise RuntimeError("the vllm engine is not started")
        job = _Job(self, request, on_event)
        self._stats["requests"] += 1
        asyncio.run_coroutine_threadsafe(self._run_job(job), self._loop)
        return job

    def _row_params(self, request: EngineRequest, group: str = "") -> list:
        """vLLM's sampling parameters for each row of ``request`` (``group``: our request's id, which the rows'
        item controls share in the worker)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        compiled = request.compiled
        s = request.sampling
        extra = None
        structured = None
        if compiled is None:
            stops = list(self.eos_token_ids)
        else:
            stops = list(compiled.stop_token_ids)
            if self.grammar_backend == "guidance" and compiled.think is None and compiled.capabilities.grammar:
                kind = compiled.constraint_kind
                grammar = kind.llguidance_grammar(compiled.constraint) if kind is not None else None
                structured = guidance_params(grammar, StructuredOutputsParams)
            if structured is None:
                extra = {EXTRA_KEY: self._files.ref(compiled)}
                if request.items is not None:  # exclude / distinct: one book per request in the worker (.item_groups)
                    extra[EXTRA_KEY]["items"] = item_extra(request.items, group or uuid.uuid4().hex, request.n)
        temperature = s.temperature
        if temperature > MAX_VLLM_TEMPERATURE:  # vLLM refuses more; the processor scales the logits instead
            extra = dict(extra or {EXTRA_KEY: {}})
            extra[EXTRA_KEY] = dict(extra[EXTRA_KEY], scale=MAX_VLLM_TEMPERATURE / temperature)
            temperature = MAX_VLLM_TEMPERATURE
        rows = []
        for i in range(request.n):
            rows.append(SamplingParams(
                n=1, temperature=temperature, top_p=s.top_p, top_k=s.top_k,
                seed=None if s.seed is None else s.seed + i, max_tokens=request.max_new_tokens,
                ignore_eos=True, stop_token_ids=stops, detokenize=False, skip_special_tokens=False,
                output_kind=RequestOutputKind.DELTA, extra_args=extra, structured_outputs=structured,
                logprobs=request.logprobs,
            ))
        return rows

    async def _run_job(self, job: _Job) -> None:
        request = job.request
        try:
            if job.cancelled.is_set():
                raise asyncio.CancelledError
            rows = self._row_params(request, job.id)
        except asyncio.CancelledError:
            self._stats["cancelled_jobs"] += 1
            job.emit(ErrorEvent("cancelled"))
            return
        except Exception as exc:
            logger.exception("preparing a vllm request failed")
            self._stats["failed_jobs"] += 1
            job.emit(ErrorEvent(f"cannot start: {type(exc).__name__}: {exc}"))
            return
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        gate = self._gate
        job.tasks = [cast(asyncio.Task, asyncio.current_task())]  # a cancel while the request waits for room
        try:
            if job.cancelled.is_set():
                raise asyncio.CancelledError
            held = [await gate.acquire(request.client, len(rows))]
        except asyncio.CancelledError:
            self._stats["cancelled_jobs"] += 1
            job.emit(ErrorEvent("cancelled"))
            return

        def row_ended(_task) -> None:  # each row's room goes back as it leaves vLLM
            if held[0] > 0:
                held[0] -= 1
                gate.release(request.client, 1)

        job.tasks = [asyncio.ensure_future(self._run_row(job, i, prompt, params)) for i, params in enumerate(rows)]
        for task in job.tasks:
            task.add_done_callback(row_ended)
        if job.cancelled.is_set():
            job._cancel_tasks()
        results = await asyncio.gather(*job.tasks, return_exceptions=True)
        if job.cancelled.is_set():
            self._stats["cancelled_jobs"] += 1
            job.emit(ErrorEvent("cancelled"))
            return
        fatal = [r for r in results if isinstance(r, BaseException)]
        if fatal:
            self._stats["failed_jobs"] += 1
            exc = fatal[0]
            job.emit(ErrorEvent(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        job.emit(DoneEvent())

    async def _run_row(self, job: _Job, index: int, prompt, params) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        request = job.request
        compiled = request.compiled
        items = request.items
        if items is not None and items.distinct:  # the replay sees its own row only: exclude and its own items
            items = ItemRequest(items.book.copy(), False, items.n_excluded)
        cursor = RowCursor(compiled, self.tokenizer, eos_token_ids=self.eos_token_ids,
                           max_new_tokens=request.max_new_tokens, items=items)
        replay_masks = not (compiled is not None and compiled.capabilities.grammar)
        if params.structured_outputs is not None:
            self._stats["guidance_rows"] += 1
        tokens: list[int] = []
        logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = [] if params.logprobs is not None else None
        failure: str | None = None
        reason = "error"
        self._stats["rows"] += 1
        self._active += 1
        try:
            async for out in self.llm.generate(prompt, params, request_id=f"{job.id}-{index}"):
                completion = out.outputs[0]
                if logprobs is not None:
                    logprobs.extend(_token_logprobs(completion.token_ids, completion.logprobs, params.logprobs))
                for token in completion.token_ids:
                    tokens.append(token)
                    self._stats["tokens"] += 1
                    if failure is None:
                        try:
                            if replay_masks:
                                cursor.step()  # trees and labels note a fallback when they compute a step
                            cursor.advance(token)
                        except Exception as exc:
                            logger.exception("a row's constraint failed")
                            failure = f"constraint failed: {type(exc).__name__}: {exc}"
                    job.emit(TokenEvent(index, token))
                if out.finished:
                    reason = completion.finish_reason or "error"
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            raise
        except Exception as exc:  # this row only (e.g. vLLM refused its parameters)
            logger.exception("a vllm row failed")
            failure = f"generation failed: {type(exc).__name__}: {exc}"
        finally:
            self._active -= 1
        if failure is not None:
            self._stats["failed_rows"] += 1
            finish, error = "error", failure
        elif reason == "stop":
            finish, error = ("error" if cursor.error else "stop"), cursor.error
            if error == ENDED_EARLY and params.structured_outputs is None:
                # only the worker ends a grammar row early: its mask was over the budget, or its cursor raised there
                error = (f"{ENDED_EARLY}: vLLM's worker ended it (a grammar mask over mask_step_budget_ms = "
                         f"{self.mask_step_budget_ms:g} ms ends a row so; the worker's log says which)")
        elif reason == "length":
            finish, error = "length", cursor.error
        else:  # "abort" and anything else vLLM may say
            self._stats["failed_rows"] += 1
            finish, error = "error", cursor.error or f"vllm finished the row with {reason!r}"
        if cursor.fell_back:
            self._stats["fallback_rows"] += 1
        job.emit(FinishedEvent(index, tokens, finish, error, cursor.fell_back, logprobs))

    # -- reports --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = dict(self._stats)
        out["scenario_files"] = len(self._files) if self._files is not None else 0
        gate = self._gate
        out.update(waiting_requests=len(gate.waiting), waited_requests=gate.stats["waited"])
        return out

    @property
    def active_rows(self) -> int:
        return self._active

    def health(self) -> dict[str, Any]:
        llm = self.llm
        return {
            "engine": self.name, "active_rows": self.active_rows, "stats": self.stats(),
            "running": llm is not None and not llm.errored,
        }

"""Model replica: the model, the decode engine, the scenarios it serves and the requests it answers.

A plain class: the app builder wraps :class:`ServeModelReplica` with ``serve.deployment``; tests construct
:class:`ModelReplica` directly with a real model and tokenizer. Its two jobs are two parts it holds: the scenario
subscription (``replica.subscriber``, ``subscriber.py``: registration with the config manager, the long poll, the
served versions) and the request handling (``replica.requests``, ``requests.py``: ``generate`` /
``generate_stream``, reading the served scenarios from the subscriber); this module loads the model, builds the
engine, makes both parts and answers Serve's calls (``generate``, ``generate_stream``, ``ping``) by them.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from config import ServerSettings
from processors import ScenarioCompiler

from ..engines import create_engine
from ..metrics import ReplicaMetrics, route_logs_to_serve
from ..protocol import GenerateRequest, GenerateResponse
from .prompt_bounds import max_token_bytes
from .requests import RequestHandler
from .subscriber import ScenarioSubscriber

__all__ = ["ModelReplica", "ServeModelReplica"]

_INLINE_CACHE_SIZE = 64


class ModelReplica:
    """Hosts the model and decodes batched, constrained requests.

    Args:
        settings: :class:`config.ServerSettings` (or its dict).
        manager: a handle to the config manager (``None``: no stored scenarios; one-off
            constraints still work).
        model, tokenizer: injected for tests; loaded from ``settings.model`` otherwise.
        register: register with ``manager`` now (ServeModelReplica registers in its async constructor instead).
        replica_id: the id it registers with (default: a new ``replica-<hex>``).
    """

    def __init__(self, settings: dict | ServerSettings, manager=None, *, model=None, tokenizer=None, register: bool = True,
                 replica_id: str | None = None):
        self.settings = settings if isinstance(settings, ServerSettings) else ServerSettings.model_validate(settings)
        route_logs_to_serve()
        self.metrics = ReplicaMetrics()
        if self.settings.torch_threads:
            import torch

            torch.set_num_threads(self.settings.torch_threads)
        if getattr(self.settings, "engine", "transformers") == "vllm":
            # vLLM loads the checkpoint in its own process (create_engine -> model_directory, which has a child process
            # write the float32 cache entry of a GGUF model when it is missing): this replica holds only the tokenizer
            if tokenizer is None:
                from ..model_loader import load_tokenizer

                tokenizer = load_tokenizer(self.settings.model)
            model = None
        elif model is None or tokenizer is None:
            import torch

            from ..model_loader import load_model_and_tokenizer

            model, tokenizer = load_model_and_tokenizer(self.settings.model, dtype=getattr(torch, self.settings.dtype))
        self.model = model
        self.tokenizer = tokenizer
        # no token is longer than this many bytes: a prompt over max_prompt_tokens times it cannot fit (a 413
        # before it is tokenized, prompt_bounds.py)
        self.max_token_bytes = max_token_bytes(tokenizer)
        self.replica_id = replica_id or f"replica-{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(self.settings, model, tokenizer)
        if self.metrics.enabled:
            self.engine.on_step = self.metrics.record_step
        self.engine.start()
        self.subscriber = ScenarioSubscriber(manager, replica_id=self.replica_id,
                                             table_delta=self.settings.replica_table_delta, metrics=self.metrics)
        # One-off constraints: the scenario pipeline, its JSON-schema and regex grammars built in a worker process
        # killed at the compile limits, the last _INLINE_CACHE_SIZE bodies kept compiled.
        compiler = ScenarioCompiler(tokenizer, self.settings.limits, cache_size=_INLINE_CACHE_SIZE)
        self._grammar_worker = compiler.grammar_worker
        self.requests = RequestHandler(self.subscriber, settings=self.settings, model=model, tokenizer=tokenizer,
                                       engine=self.engine, metrics=self.metrics, compiler=compiler,
                                       max_token_bytes=self.max_token_bytes)
        self.model_name = self.settings.model or "SmolLM2-135M-Instruct"
        if manager is not None and register:
            asyncio.run(self.subscriber.register())  # a plain constructor (tests, a driver): on an event loop of its own

    async def generate(self, request: dict | GenerateRequest) -> dict | GenerateResponse:
        """Run one request to completion (:meth:`RequestHandler.generate`): the :class:`GenerateResponse` of a
        :class:`GenerateRequest` (the ingress), the response as a dict for a dict."""
        return await self.requests.generate(request)

    async def generate_stream(self, request: dict | GenerateRequest) -> AsyncIterator[dict]:
        """The request's events (:meth:`RequestHandler.generate_stream`): ``token`` events, then ``done`` or
        ``error``. Closing this stream closes the handler's (the engine cancels the request)."""
        async with aclosing(self.requests.generate_stream(request)) as stream:
            async for event in stream:
                yield event

    def versions(self) -> dict[str, int]:
        """The scenario versions this replica serves now."""
        return self.subscriber.versions()

    def health(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "epoch": self.subscriber.epoch,
            "versions": self.versions(),
            "active_rows": self.engine.active_rows,
            "stats": self.engine.stats(),
        }

    def shutdown(self) -> None:
        self.subscriber.stop_polling()
        self.engine.stop()
        self._grammar_worker.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.shutdown()
        except Exception:
            pass

    async def ping(self) -> str:
        return self.replica_id


class ServeModelReplica(ModelReplica):
    """The Serve deployment of :class:`ModelReplica`.

    Serve runs a constructor on the replica's event loop, where a blocking ``handle.remote().result()``
    is refused; this async constructor awaits :meth:`ScenarioSubscriber.register` (the same registration as a
    plain :class:`ModelReplica`'s) before the replica takes requests. Later updates come from the poll thread.
    """

    async def __init__(self, settings: dict, manager):  # type: ignore[misc]
        # Serve's own replica id: the one its logs and the metrics' `replica` tag carry, so /healthz matches them.
        from ray import serve

        replica_id = serve.get_replica_context().replica_id.unique_id
        ModelReplica.__init__(self, settings, manager, register=False, replica_id=replica_id)
        await self.subscriber.register()

"""Model replica: the model, the decode engine, the scenarios it serves and the requests it answers.

A plain class: the app builder wraps :class:`ServeModelReplica` with ``serve.deployment``; tests construct
:class:`ModelReplica` directly with a real model and tokenizer. Its two jobs are two modules: the scenario
subscription (``subscriber.py``: registration with the config manager, the long poll, the served versions) and the
request handling (``requests.py``: ``generate`` / ``generate_stream``); this module loads the model, builds the
engine and joins them.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from config import ServerSettings
from processors import ScenarioCompiler

from ..engines import create_engine
from ..metrics import ReplicaMetrics, route_logs_to_serve
from .prompt_bounds import max_token_bytes
from .requests import RequestHandler
from .subscriber import ScenarioSubscriber

__all__ = ["ModelReplica", "ServeModelReplica"]

_INLINE_CACHE_SIZE = 64


class ModelReplica(ScenarioSubscriber, RequestHandler):
    """Hosts the model and decodes batched, constrained requests.

    Args:
        settings: :class:`config.ServerSettings` (or its dict).
        manager: a handle to the config manager (``None``: no stored scenarios; one-off
            constraints still work).
        model, tokenizer: injected for tests; loaded from ``settings.model`` otherwise.
    """

    def __init__(self, settings: dict | ServerSettings, manager=None, *, model=None, tokenizer=None, register: bool = True):
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
        self.replica_id = f"replica-{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(self.settings, model, tokenizer)
        if self.metrics.enabled:
            self.engine.on_step = self.metrics.record_step
        self.engine.start()
        ScenarioSubscriber.__init__(self, manager)
        # One-off constraints: the scenario pipeline, its JSON-schema and regex grammars built in a worker process
        # killed at the compile limits, the last _INLINE_CACHE_SIZE bodies kept compiled.
        self._compiler = ScenarioCompiler(tokenizer, self.settings.limits, cache_size=_INLINE_CACHE_SIZE)
        self._grammar_worker = self._compiler.grammar_worker
        self.model_name = self.settings.model or "SmolLM2-135M-Instruct"
        if manager is not None and register:
            asyncio.run(self._register())  # a plain constructor (tests, a driver): on an event loop of its own

    def health(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "epoch": self._epoch,
            "versions": self.versions(),
            "active_rows": self.engine.active_rows,
            "stats": self.engine.stats(),
        }

    def shutdown(self) -> None:
        self.stop_polling()
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
    is refused; this async constructor awaits :meth:`ModelReplica._register` (the same registration as a
    plain :class:`ModelReplica`'s) before the replica takes requests. Later updates come from the poll thread.
    """

    async def __init__(self, settings: dict, manager):  # type: ignore[misc]
        ModelReplica.__init__(self, settings, manager, register=False)
        # Serve's own replica id: the one its logs and the metrics' `replica` tag carry, so /healthz matches them.
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        await self._register()

"""Token generation backends behind one contract (:mod:`deployments.engines.protocol`).

A model replica creates its engine with :func:`create_engine` and talks to it only through
:class:`~deployments.engines.protocol.Engine`. Backends live in their own sub-packages
(``transformers/``: the embedded default). Importing this package imports no torch.
"""

from __future__ import annotations

from .protocol import (
    DoneEvent, Engine, EngineEvent, EngineRequest, ErrorEvent, FinishedEvent, RequestTicket, SamplingParams,
    TokenEvent,
)

__all__ = [
    "DoneEvent", "Engine", "EngineEvent", "EngineRequest", "ErrorEvent", "FinishedEvent", "RequestTicket",
    "SamplingParams", "TokenEvent", "create_engine",
]


def create_engine(settings, model, tokenizer) -> Engine:
    """The engine a replica with these ``config.ServerSettings`` runs, over an already loaded model."""
    from .transformers import DecodeEngine

    return DecodeEngine(
        model, tokenizer, max_batch_size=settings.max_batch_size, prefix_cache_tokens=settings.prefix_cache_tokens,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )

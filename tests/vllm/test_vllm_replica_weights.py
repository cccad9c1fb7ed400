"""With ``engine: vllm`` the replica's process never holds the model's weights (vLLM's worker alone does).

The replica loads only the tokenizer (test_vllm_serve.py's late replica has ``model is None``); this module covers
the one path that used to load the weights in the replica all the same: the default GGUF model without its float32
cache entry, which vLLM needs. :func:`model_directory` now has a child process write that entry, so in the calling
process every model loader may raise and the entry still appears.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

pytestmark = pytest.mark.vllm


def test_a_missing_cache_entry_is_written_without_loading_the_model_here(tmp_path, monkeypatch):
    from deployments import model_loader
    from deployments.engines.vllm import model_directory

    def refuse(*args, **kwargs):
        raise AssertionError("the replica's process loaded the model's weights")

    for name in ("load_model", "load_model_and_tokenizer", "_load_gguf_model", "_load_cached_model"):
        monkeypatch.setattr(model_loader, name, refuse)
    monkeypatch.setenv(model_loader.CACHE_ENV, str(tmp_path / "cache"))  # empty: the entry is missing
    entry = model_loader.gguf_cache_dir(model_loader.resolve_model(None))
    assert not entry.exists()

    path = model_directory(None)

    assert path == str(entry)
    assert (entry / model_loader.WEIGHTS_NAME).stat().st_size > 100_000_000  # the float32 weights
    assert json.loads((entry / model_loader.MANIFEST_NAME).read_text())
    assert (entry / "config.json").exists()
    assert model_directory(None) == path  # a second call finds the entry (no child process)


"""Model loader: GGUF -> cache -> identical model; a broken cache is rebuilt."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deployments import model_loader as ml

PROMPT = "The capital of France is"


def _logits(model, tokenizer, text=PROMPT):
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits[0]


@pytest.fixture(scope="module")
def gguf_round_trip(tmp_path_factory):
    """Load the default GGUF with an empty cache dir (writes the cache), then load again (reads it)."""
    root = tmp_path_factory.mktemp("model-cache")
    entry = ml.gguf_cache_dir(None, root)
    assert not entry.exists()
    from_gguf = ml.load_model(cache_dir=root)
    assert (entry / ml.MANIFEST_NAME).is_file()
    from_cache, tok = ml.load_model_and_tokenizer(cache_dir=root)
    return root, entry, from_gguf, from_cache, tok


def test_default_model_path():
    directory, name = ml.default_model_path()
    assert name.endswith(".gguf")
    assert os.path.isfile(os.path.join(directory, name))


def test_resolve_model(tmp_path):
    directory, name = ml.default_model_path()
    assert ml.resolve_model(os.path.join(directory, name)) == ml.ModelSource("gguf", directory, name)
    (tmp_path / "config.json").write_text("{}")
    assert ml.resolve_model(tmp_path).kind == "checkpoint"
    with pytest.raises(FileNotFoundError):
        ml.resolve_model(tmp_path / "missing")


def test_cache_round_trip_same_logits(gguf_round_trip):
    root, entry, from_gguf, from_cache, tok = gguf_round_trip
    manifest = json.loads((entry / ml.MANIFEST_NAME).read_text())
    assert "model.safetensors" in manifest["files"] and "config.json" in manifest["files"]
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temp dir left behind

    assert not from_gguf.training and not from_cache.training
    assert from_cache.dtype == torch.float32
    assert getattr(from_cache, "hf_quantizer", None) is None
    # tied embeddings survive the round trip
    assert from_cache.lm_head.weight.data_ptr() == from_cache.model.embed_tokens.weight.data_ptr()

    a, b = _logits(from_gguf, tok), _logits(from_cache, tok)
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_cached_tokenizer_matches_gguf(gguf_round_trip):
    _, _, _, _, tok = gguf_round_trip
    assert len(tok) == 49152
    assert tok.eos_token_id == 2
    gguf_tok = ml._load_gguf_tokenizer(ml.resolve_model(None))
    for text in [PROMPT, "  two spaces\tand a tab\n\nnew lines", "日本語 🎉 {\"a\": [1, 2.5e-3]}", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text)["input_ids"] == gguf_tok(text)["input_ids"]
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == gguf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_default_fixtures(model, tokenizer):
    assert model.config.vocab_size == 49152
    assert tokenizer.eos_token_id == 2
    assert not model.training


def test_broken_cache_is_rebuilt(gguf_round_trip, monkeypatch, tmp_path):
    """A corrupt weights file makes the loader fall back to the GGUF and rewrite the entry.

    The GGUF loads are replaced by the already-loaded objects to keep this test cheap.
    """
    _, entry0, from_gguf, _, tok = gguf_round_trip
    root = tmp_path / "cache"
    root.mkdir()
    # copy the good entry, then truncate its weights
    import shutil

    entry = root / entry0.name
    shutil.copytree(entry0, entry)
    with open(entry / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)

    calls = []
    monkeypatch.setattr(ml, "_load_gguf_model", lambda source: calls.append("model") or from_gguf)
    monkeypatch.setattr(ml, "_load_gguf_tokenizer", lambda source: calls.append("tok") or tok)
    rebuilt = ml.load_model(cache_dir=root)
    assert calls == ["model", "tok"]
    assert os.path.getsize(entry / "model.safetensors") == os.path.getsize(entry0 / "model.safetensors")
    assert torch.allclose(_logits(rebuilt, tok), _logits(from_gguf, tok), atol=1e-5, rtol=0)

    # an entry without its manifest (an interrupted write) is not used either
    (entry / ml.MANIFEST_NAME).unlink()
    calls.clear()
    ml.load_model(cache_dir=root)
    assert calls == ["model", "tok"]
    calls.clear()
    ml.load_model(cache_dir=root)  # now complete again: served from the cache
    assert calls == []

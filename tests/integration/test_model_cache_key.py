"""The model cache is keyed by the GGUF file's content: another copy of the same file (a second virtual
environment) finds the entry the first one wrote; a changed file does not."""

from __future__ import annotations

import json
import os
import shutil

from deployments import model_loader as ml


def test_a_copy_of_the_gguf_reuses_the_entry(tmp_path):
    directory, name = ml.default_model_path()
    original = os.path.join(directory, name)
    root = tmp_path / "cache"
    copy_dir = tmp_path / "other-venv"
    copy_dir.mkdir()
    ml._digests.clear()  # this process may have hashed the original already (for another cache root)
    copy = copy_dir / name
    shutil.copyfile(original, copy)  # another path, another time stamp, same bytes
    os.utime(copy, (1_000_000_000, 1_000_000_000))
    entry = ml.gguf_cache_dir(original, root)
    assert ml.gguf_cache_dir(str(copy), root) == entry
    # the digest of each copy is remembered under its own path (hashed once per file)
    index = json.loads((root / ml.DIGESTS_NAME).read_text())
    assert len(index) == 2 and len(set(index.values())) == 1
    assert entry.name.endswith("-" + next(iter(index.values()))[:16])

    # a complete entry written for the original is accepted for the copy
    entry.mkdir(parents=True)
    manifest = {"format": ml.CACHE_FORMAT, "source": {"path": original, **ml._source_identity(ml.resolve_model(original), root)},
                "files": []}
    (entry / ml.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert ml._read_manifest(entry, ml.resolve_model(str(copy))) is not None

    # one changed byte: another entry, and the old one is not taken for it
    with open(copy, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    ml._digests.clear()
    assert ml.gguf_cache_dir(str(copy), root) != entry
    assert ml._read_manifest(entry, ml.resolve_model(str(copy))) is None

"""RTP-LLM's tree files over real HTTP: the admin PUT accepts them and returns the loader's
``warnings``; the same body with ``strict: true`` is refused naming the problem; outputs stay paths of the tree."""

from __future__ import annotations

import uuid

import pytest
import requests

from processors.kinds.tree.treefile.load import is_tree_path
from deployments.examples import chat_root_token_id

pytestmark = pytest.mark.serve


def test_lenient_tree_put_returns_warnings_and_strict_refuses(serve_app, tokenizer):
    root, eos = chat_root_token_id(tokenizer), tokenizer.eos_token_id
    yes, no = (tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in ("yes", "no"))
    tree = {
        "start_token_id": root, "end_token_id": eos, "sep": "-", "comment": "exported from RTP-LLM",
        "prefix_dict": {str(root): [yes, -1, no, 2**33], f"{root}-{yes}": [eos], f"{root}-{no}": [eos],
                        f"{root + 1}-{yes}": [eos]},
    }
    name = f"lenient-{uuid.uuid4().hex[:8]}"
    url = f"{serve_app.url}/admin/scenarios/{name}"
    r = requests.put(url, json={"type": "tree", "tree": tree, "max_new_tokens": 4}, headers=serve_app.admin,
                     timeout=240)
    assert r.status_code == 200, r.text
    warnings = r.json()["warnings"]
    assert any("do not start with the root" in w for w in warnings), warnings
    assert any('unknown top-level field "comment" ignored' in w for w in warnings), warnings
    assert any("2 candidate id(s) negative or beyond int32 skipped" in w for w in warnings), warnings
    assert any("sep \"-\" contains '-'" in w for w in warnings), warnings
    out = serve_app.generate({"scenario": name, "messages": [{"role": "user", "content": "Yes or no?"}], "n": 4,
                              "temperature": 2.0})
    assert out.status_code == 200, out.text
    for o in out.json()["outputs"]:
        assert o["finish_reason"] == "stop" and is_tree_path(tree, o["token_ids"]), o
        assert o["token_ids"][0] in (yes, no)

    refused = requests.put(url, json={"type": "tree", "tree": tree, "strict": True}, headers=serve_app.admin,
                           timeout=240)
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert "must not contain digits or '-'" in message and 'unknown top-level field "comment"' in message, message
    assert "id -1 is negative" in message, message
    versions = requests.get(f"{url}/versions", headers=serve_app.admin, timeout=30).json()["versions"]
    assert [v["version"] for v in versions] == [1]  # nothing stored by the refused PUT

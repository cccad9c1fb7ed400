"""ConfigManager.inspect (the web console's allowed-set replay) with the real SmolLM2 tokenizer and a real Redis.

The expected allowed sets are computed here independently of the processors: from the labels tokenized with
the tokenizer, from the tree's ``prefix_dict``, and for grammars from what the grammar's language admits.
"""

from __future__ import annotations

import json

import pytest

from manager_helpers import make_manager, run_closing

from deployments.examples import build_phrase_tree, chat_root_token_id
from deployments.protocol import ServiceError

pytestmark = pytest.mark.integration

LABELS = ["positive", "negative", "neutral", "New York", "New York City"]
PHRASES = ["weather forecast", "weather report", "sports news"]


@pytest.fixture
def manager(tokenizer, data_dir):
    return make_manager(tokenizer, data_dir)


def ids_of(entries) -> list[int]:
    return [e["id"] for e in entries]


def continuation(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(" " + text, add_special_tokens=False)


def test_labels_allowed_sets_follow_the_label_tokens(manager, tokenizer):
    eos = tokenizer.eos_token_id
    seqs = {label: continuation(tokenizer, label) for label in LABELS}

    async def body():
        await manager.put("lab", {"type": "labels", "labels": LABELS})
        root = await manager.inspect("lab")
        assert root["name"] == "lab" and root["version"] == 1 and root["type"] == "labels"
        assert root["vocab_size"] == len(tokenizer) and root["end_token_id"] == eos
        assert len(root["steps"]) == 1 and root["error"] is None and not root["finished"]
        first = root["steps"][0]
        assert first["phase"] == "answer" and not first["any"] and not first["truncated"]
        assert ids_of(first["allowed"]) == sorted({s[0] for s in seqs.values()})
        assert first["count"] == len(first["allowed"]) and first["token"] is None
        for entry in first["allowed"]:
            assert entry["text"] == tokenizer.decode([entry["id"]])

        # walk "New York": at its end both EOS ("New York") and the next token of " City" are allowed
        ny, nyc = seqs["New York"], seqs["New York City"]
        assert nyc[: len(ny)] == ny
        walked = await manager.inspect("lab", None, ny)
        assert [s["index"] for s in walked["steps"]] == list(range(len(ny) + 1))
        assert all(s["token_allowed"] for s in walked["steps"][:-1])
        assert [s["token"]["id"] for s in walked["steps"][:-1]] == ny
        assert ids_of(walked["steps"][-1]["allowed"]) == sorted({eos, nyc[len(ny)]})

        last = await manager.inspect("lab", None, seqs["positive"] + [eos], 100, True)
        assert len(last["steps"]) == 1 and last["finished"]
        assert last["steps"][0]["phase"] == "finished" and ids_of(last["steps"][0]["allowed"]) == [eos]

    run_closing(manager, body)


def test_tree_allowed_sets_are_the_prefix_dict(manager, tokenizer):
    root = chat_root_token_id(tokenizer)
    tree = build_phrase_tree(tokenizer, PHRASES, root=root, end=tokenizer.eos_token_id)

    async def body():
        await manager.put("tr", {"type": "tree", "tree": tree})
        path = continuation(tokenizer, "weather report") + [tokenizer.eos_token_id]
        report = await manager.inspect("tr", None, path)
        state = str(root)
        for token, step in zip(path, report["steps"]):
            assert ids_of(step["allowed"]) == sorted(tree["prefix_dict"][state]), state
            assert step["token"]["id"] == token and step["token_allowed"]
            state = f"{state}_{token}"
        assert report["finished"] and report["error"] is None

    run_closing(manager, body)


def test_a_token_outside_the_allowed_set_stops_the_replay(manager, tokenizer):
    positive = continuation(tokenizer, "positive")
    stranger = tokenizer.encode(" banana", add_special_tokens=False)[0]

    async def body():
        await manager.put("lab", {"type": "labels", "labels": LABELS})
        report = await manager.inspect("lab", None, [positive[0], stranger, 5, 6])
        assert [s["index"] for s in report["steps"]] == [0, 1]
        bad = report["steps"][1]
        assert bad["token"]["id"] == stranger and bad["token_allowed"] is False
        assert report["error"]["index"] == 1 and report["error"]["token_id"] == stranger
        assert "not allowed at step 1" in report["error"]["message"]
        # the same with only the last step asked for: the failing step is reported
        last = await manager.inspect("lab", None, [positive[0], stranger], 10, True)
        assert [s["index"] for s in last["steps"]] == [1] and last["error"]["index"] == 1

    run_closing(manager, body)


def test_grammar_sets_are_truncated_with_their_count(manager, tokenizer):
    async def body():
        await manager.put("num", {"type": "regex", "pattern": "[0-9]{2,4}"})
        report = await manager.inspect("num", None, [], 3)
        step = report["steps"][0]
        # every allowed token decodes to digits only (a token may hold several), and the bare digits are all in
        assert step["count"] > 3 and step["truncated"] and len(step["allowed"]) == 3
        digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
        full = await manager.inspect("num", None, [], 1000)
        allowed = set(ids_of(full["steps"][0]["allowed"]))
        assert digits <= allowed and len(allowed) == step["count"]
        assert all(tokenizer.decode([t]).isdigit() for t in allowed)
        assert tokenizer.eos_token_id not in allowed  # fewer than 2 digits is not a match yet

        await manager.put("doc", {"type": "json", "max_new_tokens": 40})
        text = '{"a":[1,2]}'
        ids = tokenizer.encode(text, add_special_tokens=False)
        done = await manager.inspect("doc", None, ids + [tokenizer.eos_token_id], 5)
        assert done["error"] is None and done["finished"]
        assert all(s["token_allowed"] for s in done["steps"][:-1])
        assert tokenizer.eos_token_id in ids_of(done["steps"][len(ids)]["allowed"])  # the document is complete
        assert json.loads(tokenizer.decode(ids)) == {"a": [1, 2]}

    run_closing(manager, body)


def test_thinking_steps_allow_any_token_but_the_end(manager, tokenizer):
    eos = tokenizer.eos_token_id
    scenario = {"type": "labels", "labels": ["yes", "no"], "think": {"max_thinking_tokens": 2}}
    words = tokenizer.encode(" hmm well", add_special_tokens=False)[:2]

    async def body():
        await manager.put("th", scenario)
        report = await manager.inspect("th", None, words)
        first = report["steps"][0]
        # banned while thinking: the stop token and the begin marker's first token (no nested think block)
        nested = tokenizer.encode("<think>\n", add_special_tokens=False)[0]
        assert first["phase"] == "thinking" and first["any"] and first["count"] == len(tokenizer) - 2
        assert ids_of(first["banned"]) == sorted({eos, nested}) and first["allowed"] == []
        forced = report["steps"][-1]  # the budget is spent: the end marker is forced
        end_marker = tokenizer.encode("</think>\n\n", add_special_tokens=False)
        assert forced["phase"] == "thinking" and not forced["any"] and ids_of(forced["allowed"]) == [end_marker[0]]
        after = await manager.inspect("th", None, words + end_marker)
        answer = after["steps"][-1]
        assert answer["phase"] == "answer"
        # after the end marker (it ends in whitespace) the labels come in their bare form, no leading space
        bare = [tokenizer.encode(label, add_special_tokens=False)[0] for label in ("yes", "no")]
        assert ids_of(answer["allowed"]) == sorted(set(bare))
        refused = await manager.inspect("th", None, [eos])
        assert refused["error"]["index"] == 0 and "banned" in refused["error"]["message"]

    run_closing(manager, body)


def test_versions_errors_and_limits(manager, tokenizer):
    async def body():
        await manager.put("lab", {"type": "labels", "labels": ["red", "green"]})
        await manager.put("lab", {"type": "labels", "labels": ["blue"]})
        now = await manager.inspect("lab")
        old = await manager.inspect("lab", 1)
        assert now["version"] == 2 and old["version"] == 1
        assert ids_of(now["steps"][0]["allowed"]) == [continuation(tokenizer, "blue")[0]]
        assert ids_of(old["steps"][0]["allowed"]) == sorted({continuation(tokenizer, w)[0] for w in ("red", "green")})
        await manager.delete("lab")

        cases = [
            (("lab",), 404, "unknown scenario"),  # deleted: nothing served
            (("lab", 3), 409, "delete entry"),
            (("lab", 9), 404, "has no version 9"),
            (("nope",), 404, "unknown scenario"),
            (("bad name!",), 422, "invalid scenario name"),
            (("lab", 0), 422, "invalid version"),
            (("lab", 1, [1, len(tokenizer)]), 422, "token_ids.1"),
            (("lab", 1, [-1]), 422, "token_ids.0"),
        ]
        for args, status, text in cases:
            with pytest.raises(ServiceError) as err:
                await manager.inspect(*args)
            assert err.value.status == status and text in err.value.message, (args, err.value.message)
        still = await manager.inspect("lab", 2)  # a stored version stays inspectable after the delete
        assert still["version"] == 2 and still["steps"][0]["count"] == 1

    run_closing(manager, body)

"""The web console in headless Chromium against the shared Serve app, used the way a person would: type the
token, click a scenario, walk the tree, run the playground, roll back.

What the page shows is checked against what is computed here independently: the scenario list and history
from the API, allowed sets from the stored tree's ``prefix_dict`` and from the labels tokenized with the real
tokenizer, generated answers against the labels.
"""

from __future__ import annotations

import re

import pytest
import requests

from deployments.examples import chat_root_token_id

from playwright.sync_api import expect  # noqa: E402

pytestmark = pytest.mark.serve

TIMEOUT = 60
SENTIMENT = ["positive", "negative", "neutral"]
COLORS_1 = {"type": "labels", "labels": ["red", "green", "blue"]}
COLORS_2 = {"type": "labels", "labels": ["cyan", "magenta"]}


def _api(serve_app, path):
    r = requests.get(f"{serve_app.url}{path}", headers=serve_app.admin, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _use_token(page, token="serve-test-token"):
    page.fill("#token-input", token)
    page.click("#token-save")
    expect(page.locator("#token-status")).to_have_text("token set for this tab")


def _select(page, name):
    page.locator(f'#scenario-table tr[data-name="{name}"] button').click()
    expect(page.locator("#selected-title")).to_contain_text(name)


def _chip_ids(locator) -> list[int]:
    return [int(x) for x in locator.evaluate_all("nodes => nodes.map(n => n.dataset.id)")]


def _first_tokens(tokenizer, labels, space: str = " ") -> list[int]:
    return sorted({tokenizer.encode(space + label, add_special_tokens=False)[0] for label in labels})


def test_scenario_list_and_history(page, serve_app, screenshot):
    listing = {s["name"]: s for s in requests.get(f"{serve_app.url}/v1/scenarios", timeout=TIMEOUT).json()["scenarios"]}
    assert {"sentiment", "person", "topics"} <= set(listing)
    rows = page.locator("#scenario-table tbody tr")
    expect(rows.first).to_be_visible()
    for name in ("sentiment", "person", "topics"):
        row = page.locator(f'#scenario-table tr[data-name="{name}"]')
        expect(row).to_contain_text(listing[name]["type"])
        expect(row.locator("td.version")).to_have_text(f"v{listing[name]['version']}")
    expect(page.locator("#token-status")).to_have_text("no token: read-only")

    _select(page, "sentiment")  # without the token the history is not read, and the page says why
    expect(page.locator("#history-msg")).to_contain_text("enter the admin token")
    expect(page.locator("#history-table tbody tr")).to_have_count(0)

    _use_token(page)
    history = _api(serve_app, "/admin/scenarios/sentiment/versions")["versions"]
    shown = page.locator("#history-table tbody tr")
    expect(shown).to_have_count(len(history))
    assert [int(v) for v in shown.evaluate_all("rows => rows.map(r => r.dataset.version)")] == sorted(
        (v["version"] for v in history), reverse=True)
    current = page.locator(f'#history-table tr[data-version="{listing["sentiment"]["version"]}"]')
    expect(current).to_contain_text("(current)")
    current.locator("button.show-body").click()
    expect(page.locator("#history-body")).to_contain_text('"positive"')
    screenshot(page, "list")


def test_tree_view_walks_the_topics_tree(page, serve_app, tokenizer, screenshot):
    tree = _api(serve_app, "/admin/scenarios/topics")["scenario"]["tree"]
    root = chat_root_token_id(tokenizer)
    _use_token(page)
    _select(page, "topics")
    page.click('.tab[data-tab="tree"]')
    allowed = page.locator("#tree-allowed .tok")
    expected_root = sorted(tree["prefix_dict"][str(root)])
    expect(allowed).to_have_count(len(expected_root))
    assert _chip_ids(allowed) == expected_root
    for chip, token_id in zip(allowed.all(), expected_root):
        expect(chip).to_have_attribute("data-text", tokenizer.decode([token_id]))
    expect(page.locator("#tree-summary")).to_contain_text(f"{len(expected_root)} allowed")

    weather = tokenizer.encode(" weather", add_special_tokens=False)
    assert len(weather) == 1 and weather[0] in expected_root
    page.locator(f'#tree-allowed .tok[data-id="{weather[0]}"]').click()
    expected_next = sorted(tree["prefix_dict"][f"{root}_{weather[0]}"])
    expect(page.locator("#tree-path .tok")).to_have_count(1)
    expect(page.locator("#tree-prefix")).to_have_value(str(weather[0]))
    expect(allowed).to_have_count(len(expected_next))
    assert _chip_ids(allowed) == expected_next
    expect(page.locator("#tree-summary")).to_contain_text("step 1")
    screenshot(page, "tree")

    page.click("#tree-back")  # and back up to the root
    expect(page.locator("#tree-path .tok")).to_have_count(0)
    expect(allowed).to_have_count(len(expected_root))


def test_tree_view_of_labels_and_of_a_large_grammar_set(page, serve_app, tokenizer):
    serve_app.put("console-words", {"type": "regex", "pattern": "[a-z ]{1,40}"})
    _use_token(page)
    _select(page, "sentiment")
    page.click('.tab[data-tab="tree"]')
    allowed = page.locator("#tree-allowed .tok")
    expect(allowed).to_have_count(len(SENTIMENT))
    assert _chip_ids(allowed) == _first_tokens(tokenizer, SENTIMENT)

    page.click("#scenarios-refresh")
    _select(page, "console-words")
    r = requests.post(f"{serve_app.url}/admin/scenarios/console-words/inspect", json={"limit": 1},
                      headers=serve_app.admin, timeout=TIMEOUT)
    count = r.json()["steps"][0]["count"]
    assert count > 200  # every token of lowercase letters and spaces: the page lists 200 and says how many
    expect(page.locator("#tree-summary")).to_contain_text(f"{count} allowed, showing the first 200")
    expect(allowed).to_have_count(200)

    page.fill("#tree-prefix", "49152")  # outside the vocabulary: the server's 422 is shown
    page.click("#tree-go")
    expect(page.locator("#tree-msg")).to_contain_text("422")
    expect(page.locator("#tree-msg")).to_contain_text("outside the vocabulary")


def test_playground_shows_each_step_with_its_allowed_set(page, serve_app, tokenizer, screenshot):
    _use_token(page)
    _select(page, "sentiment")
    page.click('.tab[data-tab="playground"]')
    page.fill("#play-prompt", "I am so happy with this phone, it is great!")
    page.fill("#play-temp", "0")  # greedy
    page.click("#play-run")
    steps = page.locator("#play-steps tbody tr.step")
    expect(steps.first).to_be_visible()
    answer = page.locator("#play-output").inner_text()
    assert answer.strip() in SENTIMENT, answer
    meta = page.locator("#play-meta").inner_text()
    assert "finish: stop" in meta, meta

    chosen = [int(x) for x in steps.evaluate_all("rows => rows.map(r => r.dataset.tokenId)")]
    label_ids = tokenizer.encode(answer.strip(), add_special_tokens=False)  # after a chat prompt: no leading space
    assert chosen == label_ids + [tokenizer.eos_token_id]
    for row, token_id in zip(steps.all(), chosen):
        shown = _chip_ids(row.locator("td.allowed .tok"))
        assert token_id in shown, (token_id, shown)
        expect(row.locator("td.allowed .tok.chosen")).to_have_attribute("data-id", str(token_id))
        expect(row.locator(".ok-mark")).to_be_visible()
    assert _chip_ids(steps.first.locator("td.allowed .tok")) == _first_tokens(tokenizer, SENTIMENT, space="")
    assert _chip_ids(steps.last.locator("td.allowed .tok")) == [tokenizer.eos_token_id]
    screenshot(page, "playground")


def test_playground_on_a_json_schema_marks_every_step_allowed(page, serve_app):
    _use_token(page)
    _select(page, "person")
    page.click('.tab[data-tab="playground"]')
    page.fill("#play-prompt", "Invent a person.")
    page.fill("#play-max", "16")
    page.fill("#play-seed", "3")
    page.click("#play-run")
    steps = page.locator("#play-steps tbody tr.step")
    expect(steps.first).to_be_visible()
    meta = page.locator("#play-meta").inner_text()
    count = int(re.search(r"(\d+) tokens", meta).group(1))
    expect(steps).to_have_count(count)
    expect(page.locator("#play-steps .ok-mark")).to_have_count(count)
    expect(page.locator("#play-steps tr.invalid")).to_have_count(0)
    first = _chip_ids(steps.first.locator("td.allowed .tok"))
    assert steps.first.get_attribute("data-token-id") == str(first[0]) and len(first) == 1  # '{"' is forced


def test_rollback_with_the_token(page, serve_app, screenshot):
    v1 = serve_app.put("console-colors", COLORS_1)["version"]
    v2 = serve_app.put("console-colors", COLORS_2)["version"]
    _use_token(page)
    page.click("#scenarios-refresh")
    _select(page, "console-colors")
    expect(page.locator(f'#history-table tr[data-version="{v2}"]')).to_contain_text("(current)")
    page.locator(f'#history-table button.rollback[data-version="{v1}"]').click()
    message = page.locator("#history-msg")
    expect(message).to_contain_text(f"now version {v2 + 1}")
    expect(message).to_have_class(re.compile(r"\bok\b"))
    screenshot(page, "rollback")

    record = _api(serve_app, "/admin/scenarios/console-colors")
    assert record["version"] == v2 + 1 and record["scenario"] == COLORS_1 and record["from_version"] == v1
    listing = {s["name"]: s for s in requests.get(f"{serve_app.url}/v1/scenarios", timeout=TIMEOUT).json()["scenarios"]}
    assert listing["console-colors"]["version"] == v2 + 1
    expect(page.locator('#scenario-table tr[data-name="console-colors"] td.version')).to_have_text(f"v{v2 + 1}")
    expect(page.locator(f'#history-table tr[data-version="{v2 + 1}"]')).to_contain_text(f"rollback (from v{v1})")
    out = serve_app.generate({"scenario": "console-colors", "prompt": "Name a colour:", "max_new_tokens": 8}).json()
    assert out["version"] == v2 + 1 and out["outputs"][0]["text"].strip() in COLORS_1["labels"]


def test_a_change_without_the_token_is_refused(page, serve_app):
    serve_app.put("console-refused", COLORS_1)
    before = serve_app.put("console-refused", COLORS_2)["version"]
    page.click("#scenarios-refresh")
    _select(page, "console-refused")
    message = page.locator("#history-msg")

    expect(message).to_contain_text("enter the admin token")
    page.fill("#rollback-version", "1")  # no token at all: the page still asks, and the server refuses
    page.click("#rollback-go")
    expect(message).to_contain_text("Rollback refused (401): missing admin token")
    expect(message).to_have_class(re.compile(r"\berror\b"))
    expect(message).to_be_visible()

    _use_token(page, "not-the-token")  # a wrong token: refused as well (first the history, then the change)
    expect(message).to_contain_text("Loading the history refused (401): invalid admin token")
    page.fill("#rollback-version", "1")
    page.click("#rollback-go")
    expect(message).to_contain_text("Rollback refused (401): invalid admin token")

    _use_token(page)  # the token seen, then forgotten: the rollback button of the history is refused too
    button = page.locator('#history-table button.rollback[data-version="1"]')
    expect(button).to_be_visible()
    page.click("#token-forget")
    expect(page.locator("#token-status")).to_have_text("no token: read-only")
    button.click()
    expect(message).to_contain_text("Rollback refused (401): missing admin token")

    assert _api(serve_app, "/admin/scenarios/console-refused")["version"] == before
    assert [v["action"] for v in _api(serve_app, "/admin/scenarios/console-refused/versions")["versions"]] == ["put", "put"]

"""ChainLogitsProcessor driven as vLLM drives it (real vLLM BatchUpdate / SamplingParams, the real tokenizer and
compiled scenarios), without starting an engine: rows follow vLLM's batch (added, swapped, removed), a row advances
by its live output list, a row whose scenario cannot be loaded ends with EOS instead of taking vLLM down, the
temperature scale, and the parameter check.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from processors.scenarios import load_scenario  # noqa: E402
from deployments.engines.vllm.handoff import EXTRA_KEY, ScenarioFiles  # noqa: E402
from deployments.engines.vllm.processor import ChainLogitsProcessor  # noqa: E402
from processors import RowCursor, bitmask_to_ids, compile_scenario  # noqa: E402
from processors.masks import ALLOW, BITMASK  # noqa: E402

pytestmark = pytest.mark.vllm

LABELS = ["Sports", "Technology", "Politics", "New York City"]


@pytest.fixture(scope="module")
def setup(tokenizer):
    from deployments.engines.vllm import model_directory

    files = ScenarioFiles()
    proc = ChainLogitsProcessor(SimpleNamespace(model_config=SimpleNamespace(tokenizer=model_directory(None))),
                                torch.device("cpu"), False)
    labels = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
    regex = compile_scenario(load_scenario({"type": "regex", "pattern": "[0-9]{2}"}), tokenizer)
    yield proc, files, labels, regex
    files.close()


def _allowed(logits_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def _expected(cursor: RowCursor) -> set[int]:
    step = cursor.step()
    if step.kind == ALLOW:
        return {int(t) for t in step.payload}
    assert step.kind == BITMASK
    return {int(t) for t in bitmask_to_ids(step.payload)}


def _update(proc, size, added=(), removed=(), moved=()):
    proc.update_state(BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved)))


def test_rows_follow_the_batch_and_their_output_lists(setup, tokenizer):
    proc, files, labels, regex = setup
    vocab = len(tokenizer)
    out_labels, out_free, out_regex = [], [], []
    _update(proc, 3, added=[
        (0, SamplingParams(extra_args={EXTRA_KEY: files.ref(labels)}), [1], out_labels),
        (1, SamplingParams(), [1], out_free),
        (2, SamplingParams(extra_args={EXTRA_KEY: files.ref(regex)}), [1], out_regex),
    ])
    ref_labels, ref_regex = RowCursor(labels, tokenizer), RowCursor(regex, tokenizer)
    logits = proc.apply(torch.zeros(3, vocab))
    assert _allowed(logits[0]) == _expected(ref_labels)
    assert _allowed(logits[1]) == set(range(vocab))  # a row without our entry is left alone
    assert _allowed(logits[2]) == _expected(ref_regex)

    # vLLM swaps rows 0 and 2 and each request gets its next token: the masks follow their requests
    _update(proc, 3, moved=[(0, 2, MoveDirectionality.SWAP)])
    first = tokenizer.encode(" Sports", add_special_tokens=False)[0]
    digit = tokenizer.encode("4", add_special_tokens=False)[0]
    out_labels.append(first)
    out_regex.append(digit)
    ref_labels.advance(first)
    ref_regex.advance(digit)
    logits = proc.apply(torch.zeros(3, vocab))
    assert _allowed(logits[2]) == _expected(ref_labels)
    assert _allowed(logits[0]) == _expected(ref_regex)

    # the labels request leaves; vLLM moves the last row down into its place
    _update(proc, 2, removed=[2])
    logits = proc.apply(torch.zeros(2, vocab))
    assert _allowed(logits[0]) == _expected(ref_regex) and _allowed(logits[1]) == set(range(vocab))
    _update(proc, 0, removed=[0, 1])
    assert not proc.rows


def test_a_row_whose_scenario_cannot_be_loaded_ends_with_eos_and_others_go_on(setup, tokenizer):
    proc, files, labels, _ = setup
    broken = {"key": "0" * 24, "path": files.dir + "/missing.pkl"}  # a version never written (nor cached)
    _update(proc, 2, added=[(0, SamplingParams(extra_args={EXTRA_KEY: broken}), [1], []),
                            (1, SamplingParams(extra_args={EXTRA_KEY: files.ref(labels)}), [1], [])])
    logits = proc.apply(torch.zeros(2, len(tokenizer)))
    assert _allowed(logits[0]) == {tokenizer.eos_token_id}
    assert _allowed(logits[1]) == _expected(RowCursor(labels, tokenizer))
    _update(proc, 0, removed=[0, 1])


def test_temperature_scale_multiplies_the_row_after_the_mask(setup, tokenizer):
    proc, files, labels, _ = setup
    _update(proc, 2, added=[(0, SamplingParams(extra_args={EXTRA_KEY: {"scale": 0.25}}), [1], []),
                            (1, SamplingParams(extra_args={EXTRA_KEY: {**files.ref(labels), "scale": 0.5}}), [1], [])])
    base = torch.randn(2, len(tokenizer))
    logits = proc.apply(base.clone())
    assert torch.allclose(logits[0], base[0] * 0.25)
    allowed = sorted(_expected(RowCursor(labels, tokenizer)))
    assert torch.allclose(logits[1, allowed], base[1, allowed] * 0.5)
    assert np.isneginf(logits[1].numpy()).sum() == len(tokenizer) - len(allowed)
    _update(proc, 0, removed=[0, 1])


@pytest.mark.parametrize("extra", [{"key": "x"}, {"path": "/x"}, {"scale": 2.0}, {"scale": "1"}, "text"])
def test_malformed_extra_args_are_refused(extra):
    with pytest.raises(ValueError):
        ChainLogitsProcessor.validate_params(SamplingParams(extra_args={EXTRA_KEY: extra}))


def test_vector_lane_gives_the_per_row_masks(setup, tokenizer):
    """The processor with the vector lane (CONSTRAINED_SERVE_VECTOR_LANE=1) against the per-row one, fed the same
    batch updates and output lists: tree and label rows with token budgets (the lane), regex and free rows (per row),
    tokens drawn from what each row allows, rows ending and new ones taking their slots."""
    from deployments.engines.vllm import model_directory

    _, files, labels, regex = setup
    tree = compile_scenario(load_scenario({"type": "tree", "tree": {"start_token_id": 900, "end_token_id": 901,
        "prefix_dict": {"900": [1000, 1001], "900_1000": [1010, 1011], "900_1000_1010": [901], "900_1000_1011": [901],
                        "900_1001": [901]}}}), tokenizer)
    cfg = SimpleNamespace(model_config=SimpleNamespace(tokenizer=model_directory(None)))
    procs = [ChainLogitsProcessor(cfg, torch.device("cpu"), False) for _ in range(2)]
    procs[1].vector_lane = True
    vocab = len(tokenizer)
    rng = np.random.default_rng(0)
    kinds = [(tree, 4), (tree, 2), (labels, 8), (labels, 3), (regex, 6), (None, 5), (tree, 6), (labels, 6)]
    outs = [[[] for _ in kinds] for _ in procs]

    def params(compiled, max_tokens):
        extra = {EXTRA_KEY: files.ref(compiled)} if compiled is not None else {}
        return SamplingParams(max_tokens=max_tokens, extra_args=extra or None)

    for p, out in zip(procs, outs):
        _update(p, len(kinds), added=[(i, params(c, k), [1], out[i]) for i, (c, k) in enumerate(kinds)])
    from processors.lanes import BUDGET, lane_of

    assert sum(lane_of(r.cursor) == BUDGET for r in procs[1].rows.values() if r.cursor is not None) == 6  # trees and labels
    for step in range(10):
        raw = torch.randn(len(kinds), vocab, generator=torch.Generator().manual_seed(step))
        a = procs[0].apply(raw.clone())
        b = procs[1].apply(raw.clone())
        assert torch.equal(a, b), f"step {step}"
        for i in range(len(kinds)):
            allowed = torch.isfinite(a[i]).nonzero().flatten()
            token = int(allowed[int(rng.integers(0, allowed.numel()))])
            ended = token in (901, tokenizer.eos_token_id) or len(outs[0][i]) + 1 >= kinds[i][1]
            if ended:  # the request ends; a new one with the same scenario takes its slot
                for p, out in zip(procs, outs):
                    out[i] = []
                    _update(p, len(kinds), removed=[i], added=[(i, params(*kinds[i]), [1], out[i])])
            else:
                for out in outs:
                    out[i].append(token)
    assert procs[1].stats["failed_rows"] == procs[0].stats["failed_rows"] == 0


def _items_tree(tokenizer):
    """Three items below the root: (1000, 1010), (1000, 1011) and (1001,), ended by 901."""
    return compile_scenario(load_scenario({"type": "tree", "tree": {"start_token_id": 900, "end_token_id": 901,
        "prefix_dict": {"900": [1000, 1001], "900_1000": [1010, 1011], "900_1000_1010": [901], "900_1000_1011": [901],
                        "900_1001": [901]}}}), tokenizer)


def _item_rows(files, compiled, group, n, *, exclude=None, distinct=True, temperature=0.0, max_tokens=6):
    from deployments.engines.vllm.params import item_extra
    from processors.items import resolve_exclude

    items = resolve_exclude(compiled.constraint, exclude, distinct=distinct)
    extra = {EXTRA_KEY: {**files.ref(compiled), "items": item_extra(items, group, n)}}
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, extra_args=extra) for i in range(n)]


def test_distinct_rows_deciding_together_take_different_items_and_the_group_is_released(setup, tokenizer):
    """Two greedy rows of one distinct request whose logits both favour the same item: vLLM would sample the same
    tokens; the processor draws them in turn, so the second row takes another item, and each row ends on an item
    of its own. The request's book goes when both rows have left the batch finished."""
    proc, files, _, _ = setup
    tree = _items_tree(tokenizer)
    vocab = len(tokenizer)
    outs: list[list[int]] = [[], []]
    params = _item_rows(files, tree, "req-a", 2)
    _update(proc, 2, added=[(i, params[i], [1], outs[i]) for i in range(2)])
    assert len(proc.groups) == 1
    favour = torch.zeros(2, vocab)
    favour[:, 1000] = 5.0  # both rows want the subtree of two items first, then its first item
    favour[:, 1010] = 5.0
    chosen: list[list[int]] = [[], []]
    for _ in range(4):
        logits = proc.apply(favour.clone())
        for i in range(2):
            allowed = _allowed(logits[i])
            if outs[i] and outs[i][-1] == 901:
                continue
            assert len(allowed) == 1, allowed  # drawn here: vLLM gets that token alone
            token = allowed.pop()
            outs[i].append(token)
            chosen[i].append(token)
    items = sorted(tuple(o[:-1]) for o in outs)
    assert all(o[-1] == 901 for o in outs), outs
    assert items == [(1000, 1010), (1000, 1011)], outs  # both in the favoured subtree, different items
    _update(proc, 0, removed=[0, 1])
    assert len(proc.groups) == 0 and proc.groups.stats["released"] >= 1


def test_exclude_masks_every_row_and_an_aborted_request_is_dropped(setup, tokenizer):
    """exclude: the excluded item is never allowed; rows that leave unfinished (an abort) give back what they
    occupied, and their request's book is dropped once idle (item_groups.IDLE_SECONDS)."""
    import time

    proc, files, _, _ = setup
    tree = _items_tree(tokenizer)
    vocab = len(tokenizer)
    outs: list[list[int]] = [[], [], []]
    params = _item_rows(files, tree, "req-b", 3, exclude=[[1001]], distinct=False)
    _update(proc, 3, added=[(i, params[i], [1], outs[i]) for i in range(3)])
    logits = proc.apply(torch.zeros(3, vocab))
    assert all(_allowed(logits[i]) == {1000} for i in range(3))  # (1001,) is excluded: only the subtree of 1000
    for out in outs:
        out.append(1000)
    logits = proc.apply(torch.zeros(3, vocab))
    assert all(_allowed(logits[i]) == {1010, 1011} for i in range(3))
    _update(proc, 0, removed=[0, 1, 2])  # aborted: none finished
    assert len(proc.groups) == 1
    proc.groups.expire(time.monotonic() + 10_000)
    assert len(proc.groups) == 0 and proc.groups.stats["expired"] >= 1


def test_distinct_rows_at_different_states_are_masked_as_usual(setup, tokenizer):
    """Rows of one distinct request at different states choose among disjoint children: their whole masked
    distributions go to vLLM (nothing drawn here), and the book still counts both rows' items."""
    proc, files, _, _ = setup
    tree = _items_tree(tokenizer)
    outs: list[list[int]] = [[1000], [1001]]  # e.g. rows that come back after a preemption with their tokens
    params = _item_rows(files, tree, "req-c", 2, temperature=1.0)
    _update(proc, 2, added=[(i, params[i], [1], outs[i]) for i in range(2)])
    drawn = proc.stats["drawn"]
    logits = proc.apply(torch.zeros(2, len(tokenizer)))
    assert _allowed(logits[0]) == {1010, 1011} and _allowed(logits[1]) == {901}
    assert proc.stats["drawn"] == drawn
    outs[0].append(1010)
    outs[1].append(901)
    logits = proc.apply(torch.zeros(2, len(tokenizer)))
    assert _allowed(logits[0]) == {901}
    outs[0].append(901)
    _update(proc, 0, removed=[0, 1])
    assert "req-c" not in proc.groups.groups


AMBIGUOUS = 'start: x+ "\u2603"\nx: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x'


def test_a_grammar_row_over_the_mask_budget_gets_its_end_token_and_the_others_go_on(tokenizer, monkeypatch):
    """``mask_step_budget_ms`` in vLLM's worker: an ambiguous grammar's masks cost more at every token; once one is
    over the budget its row may emit only the end token (the replica's replay then reports the error), while a labels
    row in the same batch keeps its own mask. Before the budget, each such mask held vLLM's step for seconds."""
    from deployments.engines.vllm import model_directory
    from deployments.engines.vllm.handoff import BUDGET_ENV
    from processors.mask_budget import SETTING

    monkeypatch.setenv(BUDGET_ENV, "30")  # read when vLLM builds the processor (the replica sets it before)
    proc = ChainLogitsProcessor(SimpleNamespace(model_config=SimpleNamespace(tokenizer=model_directory(None))),
                                torch.device("cpu"), False)
    assert proc.budget.budget_ms == 30
    files = ScenarioFiles()
    try:
        grammar = compile_scenario(load_scenario({"type": "grammar", "grammar": AMBIGUOUS}), tokenizer)
        labels = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
        (aaaa,) = tokenizer.encode("aaaa", add_special_tokens=False)
        out_grammar: list[int] = []
        _update(proc, 2, added=[(0, SamplingParams(extra_args={EXTRA_KEY: files.ref(grammar)}), [1], out_grammar),
                                (1, SamplingParams(extra_args={EXTRA_KEY: files.ref(labels)}), [1], [])])
        expected_labels = _expected(RowCursor(labels, tokenizer))
        ended_at = None
        for step in range(300):
            logits = proc.apply(torch.zeros(2, len(tokenizer)))
            assert _allowed(logits[1]) == expected_labels  # the other row's mask, every step
            allowed = _allowed(logits[0])
            if allowed == {tokenizer.eos_token_id}:
                ended_at = step
                break
            assert aaaa in allowed and len(allowed) > 1
            out_grammar.append(aaaa)
        assert ended_at is not None, "no mask of the ambiguous grammar went over 30 ms in 300 tokens"
        assert proc.stats["late_rows"] == 1 and ended_at > 0
        cursor = proc.rows[0].cursor
        assert SETTING in cursor.error and "30 ms" in cursor.error, cursor.error
        # from then on only the end token, whatever the next steps bring
        assert _allowed(proc.apply(torch.zeros(2, len(tokenizer)))[0]) == {tokenizer.eos_token_id}
        _update(proc, 0, removed=[0, 1])
    finally:
        files.close()
        proc.budget.close()

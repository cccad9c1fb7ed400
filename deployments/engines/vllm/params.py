"""Parameters of the vLLM rows: what the replica puts into each row's ``SamplingParams`` and reads back from vLLM.

* :func:`guidance_params`: vLLM structured-output parameters for a grammar row (``vllm_grammar: guidance``);
* :func:`item_extra`: a request's item controls (``exclude``, ``distinct``) as plain data for
  ``extra_args[EXTRA_KEY]["items"]``, rebuilt in vLLM's worker by :func:`item_request_of` (:mod:`.item_groups`);
* :func:`_token_logprobs`: one output delta's log probabilities.

Nothing here imports vLLM.
"""

from __future__ import annotations

import json

from processors.items import ItemBook, ItemRequest

__all__ = ["guidance_params", "item_extra", "item_request_of", "resolve_filter"]


def _token_logprobs(token_ids, entries, top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """``(token_id, logprob, alternatives)`` per token of one output delta from vLLM's ``logprobs`` (a dict per token
    of token id -> ``Logprob``, the sampled token and the ``top`` best). Masked tokens (-inf) are left out of the
    alternatives: where fewer than ``top`` tokens are allowed, fewer come back."""
    out = []
    for i, token in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if not entry:
            out.append((int(token), float("nan"), []))
            continue
        chosen = entry.get(token)
        ranked = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= top and lp.logprob > float("-inf")),
                        key=lambda item: -item[1])
        out.append((int(token), float(chosen.logprob) if chosen is not None else float("nan"), ranked[:top]))
    return out


def guidance_params(grammar: str | None, params_cls):
    """vLLM structured-output parameters that build the same llguidance grammar as ``grammar`` (its JSON text, from
    the scenario's kind: :meth:`processors.kinds.base.ConstraintKind.llguidance_grammar`), or ``None``.

    Our compile step makes a one-entry llguidance grammar: a JSON schema carrying its own options
    (``x-guidance: {whitespace_flexible: false}``) or a Lark rule ``start: /regex/``. vLLM's guidance backend
    turns ``json=`` into ``grammar_from_json_schema`` (the schema's own options win over its defaults) and
    ``grammar=`` Lark text into ``grammar_from_lark``: the same grammar again.
    """
    if grammar is None:
        return None
    try:
        grammars = json.loads(grammar)["grammars"]
    except (ValueError, KeyError, TypeError):
        return None
    if len(grammars) != 1:
        return None
    entry = grammars[0]
    if entry.get("json_schema") is not None and entry.get("lark_grammar") is None:
        return params_cls(json=entry["json_schema"])
    if entry.get("lark_grammar") is not None and entry.get("json_schema") is None:
        return params_cls(grammar=entry["lark_grammar"])
    return None


def item_extra(items: ItemRequest, group: str, rows: int) -> dict:
    """The request's item controls for its rows' ``extra_args``: the group (our request, shared by its ``rows``
    vLLM requests), ``distinct``, the book of excluded items as lists (msgpack carries them to the worker), and a
    filter as the request gave it (``{"value": ...}``; the worker resolves it on its copy of the version:
    :func:`resolve_filter`)."""
    book = items.book
    out = {
        "group": group, "rows": int(rows), "distinct": bool(items.distinct), "n_excluded": int(items.n_excluded),
        "states": [int(s) for s in book.counts], "counts": [int(c) for c in book.counts.values()],
        "ends": sorted(int(e) for e in book.ends),
    }
    if items.base is not None:  # a filter: sent as the request gave it, resolved again in the worker (cached there)
        out["filter"] = {"value": items.filter, "cap": int(getattr(items.base, "cap", 0) or 0)}
    return out


def item_request_of(extra: dict, compiled=None) -> ItemRequest:
    """A fresh :class:`ItemRequest` from :func:`item_extra`'s data (each worker builds its own, once per group);
    ``compiled``: the version the rows decode, which resolves a filter (:func:`resolve_filter`)."""
    book = ItemBook()
    for state, count in zip(extra.get("states", ()), extra.get("counts", ())):
        book.add(int(state), int(count))
    for end in extra.get("ends", ()):
        book.add_end(int(end))
    request = ItemRequest(book, bool(extra.get("distinct")), int(extra.get("n_excluded", 0)))
    if extra.get("filter") is not None and compiled is not None:
        request.filter = extra["filter"].get("value")
        cap = int(extra["filter"].get("cap") or 0) or int(extra.get("rows", 1)) + int(extra.get("n_excluded", 0)) + 1
        request.base = resolve_filter(compiled, request.filter, cap)
    return request


def resolve_filter(compiled, value, cap: int):
    """The book of the items ``value`` (a request's filter, ANDed with the scenario's own) leaves out, resolved on
    this process's copy of the compiled version (its filter index caches it per filter), read with the request's
    ``cap`` (:func:`deployments.replica.item_controls.filter_cap`). The replica checked the
    filter against the same version and the service's bounds before the request came here."""
    from types import SimpleNamespace

    # the filter's bounds were checked by the replica: none here (the settings' names, read by the kind)
    unbounded = SimpleNamespace(max_filter_clauses=1 << 30, max_filter_depth=1 << 30, max_filter_values=1 << 30)
    resolved = compiled.constraint_kind.item_filter(compiled.constraint, value, unbounded)
    if resolved is None:
        raise ValueError("a filtered request's scenario has no filter index in the worker")
    return resolved.view(cap)

"""Admission of a request's item controls (``exclude``, ``distinct``, ``filter``) and of its token budget for the scenarios
whose kind has items (``capabilities.items``; the kind names their tables and any refusal): the checks that turn
bad input into a 4xx naming the field, and the shared :class:`processors.items.ItemRequest` the engine hands to
the request's rows. Rules: ``docs/design.md``,
"Item controls".
"""

from __future__ import annotations

import numpy as np

from processors.items import ItemRequest, min_item_tokens, resolve_exclude
from processors.tables import item_metrics

from ..protocol import ServiceError
from ..scenario_errors import refused_as_service_error

__all__ = ["admit_item_controls", "filter_cap"]


def filter_cap(req, compiled) -> int:
    """One more than the items a request's rows can take, occupy or exclude (its outputs or beams times the items a
    row may hold, and its ``exclude``): the passing items below a state a filtered request reads at most
    (:class:`processors.kinds.tree.filters.lazy.FilterView`)."""
    rows = max(int(getattr(req, "n", 1) or 1), int(getattr(req, "num_beams", 1) or 1))
    per_row = int((compiled.settings or {}).get("max_items", 1) or 1) if compiled is not None else 1
    return rows * per_row + len(getattr(req, "exclude", None) or ()) + 1


def admit_item_controls(req, compiled, max_new_tokens: int, limits) -> ItemRequest | None:
    """Check ``req``'s item controls and budget against its scenario; the request's :class:`ItemRequest`, or
    ``None`` when it has no controls. Both engines apply them (vLLM: ``deployments/engines/vllm/item_groups.py``).
    Raises :class:`ServiceError` (422) naming the field."""
    exclude = req.exclude
    distinct = bool(req.distinct)
    item_filter = getattr(req, "filter", None)
    if compiled is None or not compiled.capabilities.items:
        if exclude is not None or distinct or item_filter is not None:
            field = "exclude" if exclude is not None else "distinct" if distinct else "filter"
            name = compiled.kind if compiled is not None else None
            raise ServiceError(422, f"{field}: only tree and labels scenarios have items (this request is "
                                    f"{'unconstrained' if name is None else name!r})", {"field": field})
        return None
    constraint = compiled.constraint
    kind = compiled.constraint_kind
    need = min_item_tokens(constraint)
    if compiled.think is not None:
        need += len(compiled.think.end_ids)
    if max_new_tokens < need:
        raise ServiceError(
            422, f"max_new_tokens: {max_new_tokens} cannot fit one item of this scenario; the minimum is {need}"
                 + (" (the think end marker and the shortest item)" if compiled.think is not None else
                    " (the shortest item)"),
            {"field": "max_new_tokens", "minimum": need},
        )
    tables = kind.item_tables(constraint)
    # the request's filter and the scenario's own, resolved once per filter and version (cached with the version)
    with refused_as_service_error():
        resolved = kind.item_filter(constraint, item_filter, limits)
    # the most items the request's rows can take, occupy or exclude, plus one: the count of passing items a filtered
    # request needs (a state with that many passing items below it has one left for every row)
    cap = filter_cap(req, compiled)
    if resolved is not None and resolved.passing(1) == 0:
        raise ServiceError(422, "filter: no item of this scenario passes the filter", {"field": "filter",
                                                                                      "available": 0})
    # beams end on different sequences: with one item per output they need n different items, the same rule
    # as distinct (a 422 naming n and what is available, never fewer outputs than asked)
    single_item = int(compiled.settings.get("max_items", 1) or 1) <= 1
    beams_need_items = req.num_beams > 1 and req.n > 1 and single_item
    total = resolved.passing(cap) if resolved is not None else (
        int(item_metrics(tables)[1][tables.root]) if tables.root >= 0 else 0)
    if beams_need_items and not exclude:
        if tables.root >= 0 and total < req.n:
            passing = " passing the filter" if resolved is not None else ""
            raise ServiceError(422, f"n: the scenario has {total} item(s){passing}, fewer than the n={req.n} "
                                    "different outputs beam search returns", {"field": "n", "available": total})
    if not exclude and not distinct and resolved is None:
        return None
    field = "exclude" if exclude else "distinct" if distinct else "filter"
    refusal = kind.item_controls_refusal(constraint)
    if refusal is not None:
        raise ServiceError(422, f"{field}: {refusal}", {"field": field})
    if exclude is not None and len(exclude) > limits.max_exclude_items:
        raise ServiceError(
            422, f"exclude: {len(exclude)} items exceeds the limit max_exclude_items={limits.max_exclude_items}",
            {"field": "exclude", "limit_name": "max_exclude_items", "limit": limits.max_exclude_items},
        )
    # beams are always different sequences, so different items: distinct needs no shared book there
    sampled_distinct = distinct and req.num_beams == 1 and req.n > 1
    try:
        items = resolve_exclude(constraint, exclude, distinct=sampled_distinct)
    except ValueError as exc:
        raise ServiceError(422, str(exc), {"field": "exclude"}) from None
    excluded = items.n_excluded
    if resolved is not None:
        items.base, items.filter = resolved.view(cap), item_filter
        if items.book.ends:  # excluded items the filter leaves out already are not counted twice
            ends = np.fromiter(items.book.ends, dtype=np.int64, count=len(items.book.ends))
            excluded = int((~items.base.ends_taken(ends)).sum())
    if tables.root >= 0:
        free = total - excluded
        wanted = req.n if distinct or beams_need_items else 1
        if free < wanted:
            field = "n" if (distinct or beams_need_items) and free >= 1 else "exclude" if exclude else "filter"
            after = " and ".join(x for x, on in (("the filter", resolved is not None), ("exclude", bool(exclude))) if on)
            raise ServiceError(422, f"{field}: the scenario has {free} item(s) left after {after}, fewer than the "
                                    f"{wanted} asked for", {"field": field, "available": free})
    return items if (items.book or items.distinct or items.base is not None) else None

"""Catalog trees and item parsing shared by the item-control tests (transformers in-process, HTTP, and vLLM):
a tree whose items are every sequence of ``depth`` codes, and an output's tokens split back into items."""

from __future__ import annotations

import itertools

__all__ = ["filter_passes", "items_of", "product_tree"]


def product_tree(root: int, codes: list[int], depth: int, eos: int) -> dict:
    """A tree (the tree file format) whose items are all ``len(codes) ** depth`` sequences of ``depth`` codes after
    ``root``, each ended by ``eos``."""
    prefix: dict[str, list[int]] = {}
    for n in range(depth):
        for path in itertools.product(codes, repeat=n):
            prefix["_".join(map(str, (root, *path)))] = list(codes)
    for path in itertools.product(codes, repeat=depth):
        prefix["_".join(map(str, (root, *path)))] = [eos]
    return {"start_token_id": root, "end_token_id": eos, "prefix_dict": prefix}


def items_of(tokens: list[int], eos: int, sep: int | None, width: int = 3) -> list[tuple[int, ...]]:
    """The items of an output's ``tokens`` (its ``eos`` dropped): split at ``sep``, or every ``width`` tokens when
    the items are back to back (``sep`` None; the length must be a multiple of ``width``)."""
    body = tokens[:-1] if tokens and tokens[-1] == eos else tokens
    if sep is None:
        assert len(body) % width == 0, tokens
        return [tuple(body[i: i + width]) for i in range(0, len(body), width)]
    parts, cur = [], []
    for t in body:
        if t == sep:
            parts.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return parts + [tuple(cur)]


def filter_passes(item: dict | None, flt: dict) -> bool:
    """Whether an item's metadata (``None``: none) passes ``flt``, by the filter language's rules as documented
    (``processors/kinds/tree/filters/language.py``), written apart from the code under test."""
    item = item or {}
    for key, cond in flt.items():
        if key == "$and":
            ok = all(filter_passes(item, f) for f in cond)
        elif key == "$or":
            ok = any(filter_passes(item, f) for f in cond)
        else:
            ok = all(_holds(item, key, op, value)
                     for op, value in (cond.items() if isinstance(cond, dict) else [("$eq", cond)]))
        if not ok:
            return False
    return True


def _holds(item: dict, field: str, op: str, value) -> bool:
    if field not in item:
        return op in ("$ne", "$nin", "$not_contains")
    have = item[field]
    values = have if isinstance(have, list) else [have]

    def same(a, b):
        return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b

    if op in ("$eq", "$contains"):  # $contains: the list holds the value (a single value: a list of one)
        return any(same(v, value) for v in values)
    if op in ("$ne", "$not_contains"):
        return not any(same(v, value) for v in values)
    if op == "$in":
        return any(same(v, w) for v in values for w in value)
    if op == "$nin":
        return not any(same(v, w) for v in values for w in value)
    return {"$gt": have > value, "$gte": have >= value, "$lt": have < value, "$lte": have <= value}[op]

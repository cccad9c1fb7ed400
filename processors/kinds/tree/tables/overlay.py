"""Overlay versions of a catalog's tables: a PATCH's result as the tables it patched plus the changed paths only.

:func:`~processors.kinds.tree.tables.delta.patch_tables` gives the new tables byte for byte as a full compile would (states
renumbered in preorder), which makes every PATCH copy and renumber every array: seconds at 10^7 items. An overlay
version instead keeps every state of the tables it patched under its number and appends a new copy of each touched
state (path copying: the prefixes of the added and removed items, closed under their ancestors):

* the appended states' edges lead to untouched states by their old numbers, to other appended states, or to
  ``LEAF`` / ``DONE``; untouched states and their edges are the old arrays themselves, not copied;
* the root is the root's copy, so the superseded states (the touched paths' old copies) are not reachable any more:
  their rows in the arrays stay, read by nothing a row or an item walk reaches;
* each array is a :class:`~processors.kinds.tree.tables.stacked.Stacked`: the base's array followed by the appended part (``base`` is the first version
  of the chain, a plain :class:`~processors.tables.MaskTables`); the arrays a consumer indexes read through it
  without a copy (a gather splits its indices at the seam), a whole-array numpy operation reads their concatenation
  (made once per array and kept);
* the item metrics of the appended states are computed from their children, deepest first; ``uniform`` from the
  count of states whose shortest and longest way down differ, kept per version; ``deepest`` is the root's longest;
* the version is a hash of the version patched and the appended arrays (no pass over the base's bytes).

Work and memory per PATCH follow the touched states and their edges (a 2,000-item PATCH of 4-token ids at 10^7
items: about 4,000 states and 0.4 * 10^6 edges, most of them the root's and the first level's), not the catalog.

The net delta from the base (``overlay_add`` / ``overlay_remove``: items present that the base lacks, and the
reverse) is kept on each version, so :func:`fold` gives the plain tables of the same items: ``patch_tables`` of the
base with it, byte for byte a full compile. The manager folds once the appended part passes a share of the base
(:func:`needs_fold`). ``tests/unit/test_tree_overlay.py`` checks on random catalogs and chains of deltas that every
state reachable in an overlay answers as the folded tables' (its tokens, targets and item metrics) and that the fold
is the full compile.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from config.cancel import checkpoint
from processors.tables import _UNSET, DONE, LEAF, MaskTables, content_hash, item_metrics

from processors.kinds.tree.tables.delta import ABSENT, max_remaining, patch_tables, settle
from processors.kinds.tree.tables.stacked import Stacked

__all__ = ["Stacked", "fold", "is_overlay", "missing_base", "needs_fold", "overlay_base", "overlay_tables", "pickled",
           "register_base", "resolve", "restored"]

_INT32_MAX = np.iinfo(np.int32).max
FOLD_SHARE = 0.25  # needs_fold: the appended edges past this share of the base's


# -- travel: an overlay is pickled without its base ----------------------------------------------------------
# The bases this process holds, by version: the plain tables an overlay version pickled elsewhere names. A replica
# holds the base it served (the version a PATCH patched) and gets only the appended parts; a process without that
# base (a replica started after the PATCH) asks the manager for it (``missing_base`` / ``resolve``).
_BASES: "weakref.WeakValueDictionary[str, MaskTables]" = weakref.WeakValueDictionary()
_PARTS = "_overlay_parts"
_KEPT = ("root", "end_token_id", "vocab_size", "warnings", "version", "_uneven", "overlay_add", "overlay_remove")


def register_base(tables: MaskTables) -> None:
    """``tables`` (plain) may be named as a base by an overlay that reaches this process."""
    if "overlay_base" not in tables.__dict__:
        _BASES[tables.version] = tables


def pickled(tables: MaskTables) -> dict[str, Any]:
    """The pickled state of an overlay version: its appended parts and its base's version, not the base's arrays."""
    d: dict[str, Any] = tables.__dict__
    min_rem, items, uniform, deepest = d["_item_metrics"]
    state = {key: d[key] for key in _KEPT}
    state[_PARTS] = {"base": d["overlay_base"].version, "offsets": d["offsets"].tail, "tokens": d["tokens"].tail,
                     "next_state": d["next_state"].tail, "min": min_rem.tail, "items": items.tail,
                     "max": d["_max_remaining"].tail if "_max_remaining" in d else d["_max_tail"],
                     "uniform": uniform, "deepest": deepest}
    return state


def restored(tables: MaskTables, state: dict[str, Any]) -> None:
    """Unpickle an overlay version (:func:`pickled`): whole when its base is held here, else waiting for it
    (:func:`missing_base`, :func:`resolve`)."""
    tables.__dict__.update(state)
    base = _BASES.get(state[_PARTS]["base"])
    if base is not None:
        _attach(tables, base)


def missing_base(tables: Any) -> str | None:
    """The version of the base an unpickled overlay still waits for (None: complete, or not an overlay)."""
    parts = getattr(tables, "__dict__", {}).get(_PARTS) if isinstance(tables, MaskTables) else None
    return None if parts is None else parts["base"]


def resolve(tables: MaskTables, base: MaskTables) -> None:
    """Complete an overlay that waited for its base (``base``: those plain tables, fetched)."""
    if base.version != missing_base(tables):
        raise ValueError(f"tables {base.version} are not the base {missing_base(tables)} of this overlay")
    register_base(base)
    _attach(tables, base)


def _attach(tables: MaskTables, base: MaskTables) -> None:
    parts = tables.__dict__.pop(_PARTS)
    min_b, items_b, _, _ = item_metrics(base)
    fields = {"offsets": Stacked(base.offsets, parts["offsets"]), "tokens": Stacked(base.tokens, parts["tokens"]),
              "next_state": Stacked(base.next_state, parts["next_state"]),
              "_item_metrics": (Stacked(min_b, parts["min"]), Stacked(items_b, parts["items"]), parts["uniform"],
                                parts["deepest"]),
              "_max_tail": parts["max"], "overlay_base": base}  # (max_remaining: made when a delta needs it)
    tables.__dict__.update(fields)


def is_overlay(tables) -> bool:
    return isinstance(tables, MaskTables) and "overlay_base" in tables.__dict__


def overlay_base(tables: MaskTables) -> MaskTables:
    """The plain tables an overlay version's chain starts from (``tables`` itself when plain)."""
    return tables.__dict__.get("overlay_base", tables)


def needs_fold(tables: MaskTables, share: float = FOLD_SHARE) -> bool:
    """The appended part of an overlay is past ``share`` of its base's edges (or states): time to fold it."""
    if not is_overlay(tables):
        return False
    base = tables.__dict__["overlay_base"]
    grown_edges = tables.tokens.size - base.tokens.size
    grown_states = tables.offsets.size - base.offsets.size
    return grown_edges > share * max(base.tokens.size, 1) or grown_states > share * max(base.offsets.size - 1, 1)


def fold(tables: MaskTables) -> MaskTables:
    """The plain tables of an overlay version's items: its base patched by the net delta
    (:func:`~processors.kinds.tree.tables.delta.patch_tables`, byte for byte the full compile); a plain version as it is."""
    if not is_overlay(tables):
        return tables
    d = tables.__dict__
    folded = patch_tables(d["overlay_base"], sorted(d["overlay_add"]), sorted(d["overlay_remove"]))
    if folded is None:  # (a base always has a root state: overlay_tables makes none of tables without one)
        raise RuntimeError("an overlay's base has no root state")
    return folded


def _parts(arr) -> tuple[np.ndarray, np.ndarray]:
    return (arr.head, arr.tail) if isinstance(arr, Stacked) else (arr, arr[:0])


def _gather_metric(values, at: np.ndarray, tail: np.ndarray, start: int) -> np.ndarray:
    """``values`` of the states ``at``: the old version's (``values``) below ``start``, this PATCH's (``tail``)
    from it."""
    new = at >= start
    out = values.take(np.where(new, 0, at)).astype(np.int64) if not new.all() else np.zeros(at.size, np.int64)
    if new.any():
        out[new] = tail[at[new] - start]
    return out


def overlay_tables(tables: MaskTables, add: Iterable[Sequence[int]], remove: Iterable[Sequence[int]]) -> MaskTables | None:
    """The tables of ``tables``' items with ``add`` added and ``remove`` removed, as an overlay version over
    ``tables`` (see the module): the same answers from the root as :func:`~processors.kinds.tree.tables.delta.patch_tables`
    gives. ``tables`` itself when nothing changes; ``None`` when no overlay can say it (the root would not be a
    state any more, or ``tables`` has no root): the caller patches or compiles in full."""
    if tables.root < 0:
        return None
    touched = settle(tables, add, remove)
    if touched is None:
        return tables
    if not touched.is_state[0]:
        return None
    node, parent, token, is_state, alive = touched.node, touched.parent, touched.token, touched.is_state, touched.alive
    end, vocab = tables.end_token_id, np.int64(tables.vocab_size)
    n_old_states, n_old_edges = tables.n_states, tables.n_edges
    # the appended states: every touched path that is a state after the delta, numbered level by level (by the
    # parent's new number, then token: the same numbers whatever order the delta came in)
    new_id = np.full(node.size, -1, dtype=np.int64)
    new_id[0] = n_old_states
    count = 1
    for level in touched.levels[1:]:
        q = level[is_state[level]]
        if q.size:
            q = q[np.lexsort((token[q], new_id[parent[q]]))]
            new_id[q] = n_old_states + count + np.arange(q.size, dtype=np.int64)
            count += q.size
    built = np.flatnonzero(new_id >= 0)
    built = built[np.argsort(new_id[built])]
    # their edges: a copied state's old ones, edited where a touched child appears, goes or changes its target;
    # plus the end edge where an item starts or stops ending there
    child = np.arange(1, node.size)
    child = child[is_state[parent[child]]]
    up = parent[child]
    target = np.where(is_state[child], new_id[child], LEAF)
    was = node[child] != ABSENT
    appear, stay, gone = ~was & alive[child], was & alive[child], was & ~alive[child]
    end_in = touched.new_end[built] & ((node[built] < 0) | ~touched.was_end[built])
    end_out = (node[built] >= 0) & touched.was_end[built] & ~touched.new_end[built]
    copied = built[node[built] >= 0]
    copied = copied[np.argsort(node[copied])]
    old_nodes = node[copied]
    lo = tables.offsets[old_nodes].astype(np.int64)
    counts = tables.offsets[old_nodes + 1].astype(np.int64) - lo
    firsts = np.zeros(copied.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=firsts[1:])
    edges = np.repeat(lo - firsts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    states = np.repeat(new_id[copied], counts)
    tokens = tables.tokens[edges].astype(np.int64)
    targets = tables.next_state[edges].astype(np.int64)
    keep = np.ones(edges.size, dtype=bool)
    if stay.any():
        at = edges.searchsorted(tables.find_edges(node[up[stay]], token[child[stay]]))
        targets[at] = target[stay]
    drop_states = np.concatenate((node[up[gone]], node[built[end_out]]))
    if drop_states.size:
        drop_tokens = np.concatenate((token[child[gone]], np.full(int(end_out.sum()), end, dtype=np.int64)))
        keep[edges.searchsorted(tables.find_edges(drop_states, drop_tokens))] = False
    n_end = int(end_in.sum())
    states = np.concatenate((states[keep], new_id[up[appear]], new_id[built[end_in]]))
    tokens = np.concatenate((tokens[keep], token[child[appear]], np.full(n_end, end, dtype=np.int64)))
    targets = np.concatenate((targets[keep], target[appear], np.full(n_end, DONE, dtype=np.int64)))
    order = np.argsort(states * vocab + tokens, kind="stable")
    states, tokens, targets = states[order], tokens[order], targets[order]
    new_counts = np.bincount(states - n_old_states, minlength=count)
    checkpoint()
    # the appended states' item metrics, deepest first (their children: untouched old states, or appended deeper)
    min_old, items_old, _, _ = item_metrics(tables)
    max_old = max_remaining(tables)
    add_min = np.empty(count, dtype=np.int64)
    add_max = np.empty(count, dtype=np.int64)
    add_items = np.empty(count, dtype=np.int64)
    starts_all = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(new_counts, out=starts_all[1:])
    depth = touched.depth[built]
    for d in np.unique(depth)[::-1].tolist():
        local = new_id[built[depth == d]] - n_old_states
        c = new_counts[local]
        starts = np.zeros(local.size, dtype=np.int64)
        np.cumsum(c[:-1], out=starts[1:])
        e = np.repeat(starts_all[local] - starts, c) + np.arange(int(c.sum()), dtype=np.int64)
        tgt = targets[e]
        inner = tgt >= 0
        at = np.maximum(tgt, 0)
        special = np.where(tgt == DONE, 0, 1)
        e_min = np.where(inner, _gather_metric(min_old, at, add_min, n_old_states), special)
        e_max = np.where(inner, _gather_metric(max_old, at, add_max, n_old_states), special)
        e_items = np.where(inner, _gather_metric(items_old, at, add_items, n_old_states), 1)
        add_min[local] = np.minimum(np.minimum.reduceat(e_min, starts) + 1, _UNSET)
        add_max[local] = np.minimum(np.maximum.reduceat(e_max, starts) + 1, _UNSET)
        add_items[local] = np.minimum(np.add.reduceat(e_items, starts), _INT32_MAX)
    # uniform: no live state whose shortest and longest way down differ (the superseded old copies leave the count)
    superseded = node[node >= 0]
    uneven = (_uneven(tables) - int(np.count_nonzero(min_old.take(superseded) != max_old.take(superseded)))
              + int(np.count_nonzero(add_min != add_max)))
    base = overlay_base(tables)
    register_base(base)
    head_off, tail_off = _parts(tables.offsets)
    tail_off = np.concatenate((tail_off, n_old_edges + starts_all[1:]))
    arrays = {}
    for name, add_part in (("tokens", tokens), ("next_state", targets)):
        head, tail = _parts(getattr(tables, name))
        arrays[name] = Stacked(head, np.concatenate((tail, add_part.astype(np.int32))))
    metrics = []
    for values, add_part in ((min_old, add_min), (items_old, add_items), (max_old, add_max)):
        head, tail = _parts(values)
        metrics.append(Stacked(head, np.concatenate((tail, add_part.astype(np.int32)))))
    root = int(n_old_states)
    version = content_hash("overlay", tables.version, starts_all, tokens, targets, root)
    out = object.__new__(MaskTables)
    fields = {"offsets": Stacked(head_off, tail_off.astype(head_off.dtype)), "tokens": arrays["tokens"],
              "next_state": arrays["next_state"], "root": root, "end_token_id": int(end),
              "vocab_size": int(tables.vocab_size), "warnings": (), "version": version,
              "_item_metrics": (metrics[0], metrics[1], uneven == 0, int(add_max[0])),
              "_max_remaining": metrics[2], "_uneven": uneven, "overlay_base": base}
    # the net delta from the base: what the fold applies to it
    paths = touched.paths
    eff_add = {paths[i] for i in np.flatnonzero(touched.is_add).tolist()}
    eff_remove = {paths[i] for i in np.flatnonzero(touched.is_remove).tolist()}
    old_add = tables.__dict__.get("overlay_add", frozenset())
    old_remove = tables.__dict__.get("overlay_remove", frozenset())
    fields["overlay_add"] = frozenset((old_add - eff_remove) | (eff_add - old_remove))
    fields["overlay_remove"] = frozenset((old_remove - eff_add) | (eff_remove - old_add))
    for key, value in fields.items():
        object.__setattr__(out, key, value)
    return out


def _uneven(tables: MaskTables) -> int:
    """How many states of ``tables`` have a shortest way down other than their longest (0 for a uniform tree)."""
    cached = tables.__dict__.get("_uneven")
    if cached is None:
        min_rem, _, uniform, _ = item_metrics(tables)
        cached = 0 if uniform else int(np.count_nonzero(np.asarray(min_rem) != np.asarray(max_remaining(tables))))
        object.__setattr__(tables, "_uneven", cached)
    return cached

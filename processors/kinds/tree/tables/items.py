"""The items a compiled tree serves, read from its tables (``MaskTables``): every path from the root that the
decoding may end with the end token. The PATCH of a tree given inline or by file starts from these (its first
PATCH turns it into a catalog, ``deployments/manager/catalog_delta.py``), read from the tables the manager already
holds instead of parsing and loading the stored body again.

The same items as ``processors.kinds.tree.catalog.catalog.items_from_tree`` of the loaded tree (a state without edges and a
``LEAF`` target allow only the end token: an item ends there; a ``DONE`` edge ends one at its state; states no
path reaches give none; a tree whose root allows only the end token gives the empty item), in another order:
``tests/unit/test_tree_delta.py`` compares both."""

from __future__ import annotations

import numpy as np

from config.cancel import checkpoint

from processors.tables import DONE, LEAF, MaskTables

__all__ = ["tree_items"]


def tree_items(tables: MaskTables) -> tuple[np.ndarray, np.ndarray]:
    """``(flat, lengths)``: every item's token ids concatenated (int64) and each item's length, with array passes
    (a level of the tree each to find the reachable states, then a level each to write the paths)."""
    if tables.root == LEAF:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    offsets, tokens, nxt = tables.offsets, tables.tokens, tables.next_state
    counts = np.diff(offsets)
    # reachable states level by level: per node (index in discovery order) its state, parent node and token
    states, parents, toks, depths = [np.array([tables.root], dtype=np.int64)], [np.array([-1])], [np.array([0])], [0]
    ends_node, ends_extra = [], []  # an item: a node's path, plus a last token (or -1)
    first = 0
    frontier = states[0]
    while frontier.size:
        checkpoint()
        c = counts[frontier]
        node_ids = first + np.arange(frontier.size, dtype=np.int64)
        ends_node.append(node_ids[c == 0])  # no edge: only the end token
        ends_extra.append(np.full(int((c == 0).sum()), -1, dtype=np.int64))
        owner = np.repeat(node_ids, c)
        edges = np.repeat(offsets[frontier] - np.concatenate(([0], np.cumsum(c)[:-1])), c) + np.arange(int(c.sum()))
        target, token = nxt[edges], tokens[edges].astype(np.int64)
        done, leaf, inner = target == DONE, target == LEAF, target >= 0
        ends_node += [owner[done], owner[leaf]]
        ends_extra += [np.full(int(done.sum()), -1, dtype=np.int64), token[leaf]]
        first += frontier.size
        frontier = target[inner].astype(np.int64)
        states.append(frontier)
        parents.append(owner[inner])
        toks.append(token[inner])
        depths.append(depths[-1] + 1)
    parent = np.concatenate(parents)
    token_of = np.concatenate(toks)
    depth = np.concatenate([np.full(s.size, d, dtype=np.int64) for s, d in zip(states, depths)])
    node = np.concatenate(ends_node)
    extra = np.concatenate(ends_extra)
    lengths = depth[node] + (extra >= 0)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    has = extra >= 0
    flat[(starts + lengths - 1)[has]] = extra[has]
    pos = starts + depth[node] - 1  # the node's own token, then its ancestors', from the end of its path back
    cur = node
    active = depth[cur] > 0
    pos, cur = pos[active], cur[active]
    while cur.size:
        checkpoint()
        flat[pos] = token_of[cur]
        cur, pos = parent[cur], pos - 1
        active = depth[cur] > 0
        pos, cur = pos[active], cur[active]
    return flat, lengths

"""A catalog's compiled tables, whatever its size: a whole compile of its trie (:mod:`processors.kinds.tree.tables.trie`)
or, past :data:`~processors.kinds.tree.tables.chunks.CHUNK_IDS` ids, a compile in chunks of its root's subtrees
(:mod:`processors.kinds.tree.tables.chunks`), byte for byte the same tables."""

from __future__ import annotations

import numpy as np

from processors.kinds.tree.tables.chunks import CHUNK_IDS, chunked_tables
from processors.kinds.tree.tables.trie import CatalogItems, whole_tables
from processors.tables import MaskTables

__all__ = ["catalog_tables"]


def catalog_tables(catalog: CatalogItems, vocab_size: int) -> MaskTables:
    """The compiled tables of ``catalog`` (:func:`whole_tables`); a catalog of more than :data:`CHUNK_IDS` ids is
    compiled in chunks of its root's subtrees, in bounded memory and to the same bytes (:func:`chunked_tables`)."""
    if np.asarray(catalog.flat).size > CHUNK_IDS:
        return chunked_tables(catalog, vocab_size)
    return whole_tables(catalog, vocab_size)

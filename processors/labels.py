"""The label trie's public import path (``processors.LabelTables``, ``processors.tokenize_continuation``): the code
is the labels kind's, :mod:`processors.kinds.labels.trie`."""

from .kinds.labels.trie import LabelCursor, LabelTables, build_label_tables, tokenize_continuation

__all__ = ["LabelCursor", "LabelTables", "build_label_tables", "tokenize_continuation"]

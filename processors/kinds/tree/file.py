"""Moved: the tree file loader is :mod:`processors.kinds.tree.treefile.load`. Its names are still importable from
here, with a ``DeprecationWarning`` naming the new place (:mod:`config.moved`)."""

from config.moved import forward


def __getattr__(name: str):
    return forward(__name__, name)

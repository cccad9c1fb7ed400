"""The name ``processors/tables.py`` imports from here; the module is :mod:`processors.kinds.tree.treefile.scan`."""

from processors.kinds.tree.treefile.scan import extend_hash

__all__ = ["extend_hash"]

"""The names ``processors/tables.py`` imports from here; the module is :mod:`processors.kinds.tree.tables.overlay`."""

from processors.kinds.tree.tables.overlay import pickled, register_base, restored

__all__ = ["pickled", "register_base", "restored"]

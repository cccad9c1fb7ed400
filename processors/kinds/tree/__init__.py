"""The ``tree`` kind: a token tree (inline or a tree file) compiled into CSR mask tables; items, item controls, PATCH of items.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``kind`` its compile side (registered
with :mod:`processors.registry` when the registry loads the kinds). Importing this package imports neither.
"""

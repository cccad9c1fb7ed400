"""The ``labels`` kind: a label set compiled into a token trie; items, item controls, PATCH of labels.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``kind`` its compile side (registered
with :mod:`processors.registry` when the registry loads the kinds). Importing this package imports neither.
"""

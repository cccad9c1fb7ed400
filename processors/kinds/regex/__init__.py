"""The ``regex`` kind: a regular expression as an llguidance grammar.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``kind`` its compile side (registered
with :mod:`processors.registry` when the registry loads the kinds). Importing this package imports neither.
"""

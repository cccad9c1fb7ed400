"""The ``json_schema`` and ``json`` kind: a JSON Schema (or any JSON value) as an llguidance grammar; outputs validated.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``kind`` its compile side (registered
with :mod:`processors.registry` when the registry loads the kinds). Importing this package imports neither.
"""

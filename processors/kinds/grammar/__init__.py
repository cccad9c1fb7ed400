"""The ``grammar`` kind: a Lark grammar (llguidance's dialect), also reached as vLLM's ``structured_outputs.grammar``.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``kind`` its compile side (registered
with :mod:`processors.registry` when the registry loads the kinds). Importing this package imports neither.
"""

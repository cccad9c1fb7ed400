"""The ``tools`` kind: a stored tool set compiled into the JSON-schema grammar of its calls.

``spec`` is its config model (torch-free; a member of ``processors.scenarios.Scenario``), ``plan`` the call schema
of a tool set and the reading of an output as calls (torch-free: a request's own tools use it too), ``kind`` its
compile side (registered with :mod:`processors.registry` when the registry loads the kinds). Importing this
package imports none of them.
"""

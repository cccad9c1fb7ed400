"""The OpenAI-compatible APIs, translated to and from the native request: chat completions and completions
(:mod:`.api`, their models in :mod:`.models`, streaming in :mod:`.stream`), the Responses API (:mod:`.responses`,
:mod:`.responses_stream`) and tool calls (:mod:`.tool_calls`). No HTTP here: the ingress's routes call these."""

"""Tool definitions and tool-call turns in a chat prompt (OpenAI ``tools``, assistant ``tool_calls``, ``tool`` turns).

:func:`render_tools` prepares the messages of a conversation for ``tokenizer.apply_chat_template``:

* a chat template that takes tools (its text uses ``tools``: Qwen, Llama 3.1+, Hermes, ...) gets the function
  definitions as its ``tools`` argument and the messages as they are (assistant ``tool_calls`` with ``arguments``
  as objects, ``tool`` turns with ``tool_call_id``): the model sees tools the way it was trained to;
* any other template (SmolLM2's among them) gets plain text turns: a system message listing the functions and
  the call format (:data:`TOOLS_SYSTEM_PROMPT`, appended to the conversation's own system message when it has
  one), each earlier call written as the JSON the model would write (``{"name": ..., "arguments": {...}}``), and
  each ``tool`` result as a user turn ``<tool_response>...</tool_response>``.

The call format is the one the service constrains the output to (``deployments/openai/tool_calls.py``): a JSON object
``{"name": ..., "arguments": {...}}``, or a JSON list of them for several calls. Pure Python, no dependencies.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["TOOLS_SYSTEM_PROMPT", "render_tools", "template_takes_tools"]

#: the system text that lists the functions for a chat template that does not take tools ({functions}: one JSON
#: line per function: name, description, parameters)
TOOLS_SYSTEM_PROMPT = (
    "You may call functions. The functions, each with the JSON Schema of its arguments:\n{functions}\n"
    'To call a function, answer with only a JSON object {{"name": <function name>, "arguments": <arguments '
    "object>}} (several calls: a JSON list of such objects). A function's result comes back in a "
    "<tool_response> message."
)


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def _arguments(value: Any) -> Any:
    """A call's arguments as an object when they are JSON text (what OpenAI clients send back); text that is not
    JSON, or nested deeper than the parser can go, stays text (the ingress refuses arguments nested deeper than
    ``limits.max_json_depth`` before they come here: ``deployments.openai.tool_calls.check_arguments``)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    return json.dumps({"name": function.get("name"), "arguments": _arguments(function.get("arguments"))},
                      ensure_ascii=False)


def render_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages to render and the ``tools`` argument for ``apply_chat_template`` (``None``: leave it out).

    ``messages``: dicts with ``role`` (``system``, ``user``, ``assistant``, ``tool``), ``content`` and, where
    they apply, ``tool_calls`` (OpenAI's shape) and ``tool_call_id``. ``tools``: OpenAI function tools
    (``{"type": "function", "function": {"name", "description", "parameters"}}``). Messages without tool parts
    and no tools come back unchanged.
    """
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not tools and not has_tool_turns:
        return messages, None
    if template_takes_tools(tokenizer):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{**c, "function": {**(c.get("function") or {}),
                                            "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
                         for c in m["tool_calls"]]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, list(tools) if tools else None
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif m.get("tool_calls"):
            texts = [_call_text(c) for c in m["tool_calls"]]
            text = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
            out.append({"role": role, "content": f"{content}\n{text}" if content else text})
        else:
            out.append({"role": role, "content": content})
    if tools:
        functions = "\n".join(
            json.dumps({key: value for key, value in (("name", f.get("name")), ("description", f.get("description")),
                                                      ("parameters", f.get("parameters"))) if value is not None},
                       ensure_ascii=False)
            for f in ((t.get("function") or {}) for t in tools))
        system = TOOLS_SYSTEM_PROMPT.format(functions=functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None

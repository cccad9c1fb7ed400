"""The OpenAI-compatible request and response bodies (pydantic models) of ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``; their mapping to and from the native API is in
``deployments/openai/api.py``, which re-exports them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.protocol import ChatMessage, Usage
from deployments.openai.tool_calls import Tool, ToolChoice

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# --------------------------------------------------------------------------------------------- models


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = Field(default=False, description="Send a last chunk with the token usage.")


class StructuredOutputs(BaseModel):
    """A one-off constraint (vLLM's ``structured_outputs``): exactly one of ``choice``, ``json``, ``regex``,
    ``grammar``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    choice: list[str] | None = Field(default=None, min_length=1, description="The output is one of these strings.")
    json_: dict[str, Any] | str | None = Field(
        default=None, alias="json", description="A JSON Schema (object or JSON text) the output must satisfy."
    )
    regex: str | None = Field(default=None, min_length=1, description="A regular expression the output must match.")
    grammar: str | None = Field(
        default=None, min_length=1, description="A Lark grammar (llguidance's dialect) the output must be a sentence of."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [key for key, name in structured_keys().items() if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(repr(k) for k in structured_keys())} "
                             f"(got {given or 'none'})")
        return self


def structured_keys() -> dict[str, str]:
    """The keys of ``structured_outputs`` (as the client writes them: ``json``, not ``json_``) -> the attribute of
    :class:`StructuredOutputs`, in order; each also has vLLM's older ``guided_<key>`` request field."""
    return {field.alias or name: name for name, field in StructuredOutputs.model_fields.items()}


#: OpenAI / vLLM body fields that are accepted and have no effect here (documented in the README)
IGNORED_FIELDS = frozenset({
    "user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
    "guided_decoding_backend", "request_id", "priority",
})
#: OpenAI fields accepted only with the value that means "off" (anything else is a 400 naming the field)
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({}, None), "tools": ([], None), "tool_choice": ("none", None), "functions": ([], None),
    "function_call": ("none", None), "best_of": (1, None), "echo": (False, None), "suffix": (None, ""),
    "min_tokens": (0, None), "skip_special_tokens": (True, None), "include_stop_str_in_output": (False, None),
    "modalities": (["text"], None), "reasoning_effort": (None,),
}
#: request fields of the native API that may ride in an OpenAI body (the ``extra_body`` of the openai client)
#: when the native request knows them: the item controls (exclude, distinct, ...)
PASSTHROUGH_FIELDS = ("exclude", "distinct", "filter", "max_items", "separator_token_id", "fixed_width")


class _OpenAIBody(BaseModel):
    """Fields shared by the OpenAI-style routes.

    Fields outside the model: those in ``IGNORED_FIELDS`` are ignored, those in ``NEUTRAL_FIELDS`` accepted at
    their neutral value, the item controls in ``PASSTHROUGH_FIELDS`` go to the native request, and any other is
    refused with a 400 naming it.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(
        default=None, description="The served model's name (GET /v1/models) or 'default'; another name is a 404."
    )
    scenario: str | None = Field(default=None, description="Extra field: name of a stored scenario.")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="Extra field: a one-off constraint (exactly one of choice, json, regex, grammar)."
    )
    guided_choice: list[str] | None = Field(default=None, description="vLLM's older name for structured_outputs.choice.")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's older name for structured_outputs.json.")
    guided_regex: str | None = Field(default=None, description="vLLM's older name for structured_outputs.regex.")
    guided_grammar: str | None = Field(default=None, description="vLLM's older name for structured_outputs.grammar.")
    num_beams: int = Field(default=1, ge=1, strict=True, description="Extra field: beam search width (1 = sampling).")
    stop: str | list[str] | None = Field(
        default=None, description="Stop strings (at most 16): a choice ends before the first one it produces."
    )
    logprobs: bool | int | None = Field(
        default=None, description="Chat: true for the log probability of each output token. Completions: an integer, "
                                  "the number of most likely alternatives per token."
    )
    top_logprobs: int | None = Field(
        default=None, ge=0, le=20, strict=True, description="Chat: most likely alternatives per token (needs logprobs)."
    )
    # strict, as in GenerateRequest: true is not 1, and floats must be finite
    max_tokens: int | None = Field(default=None, ge=1, strict=True, description="Most tokens to generate per choice.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, strict=True, description="Same as max_tokens (the newer OpenAI name); wins when both are set."
    )
    temperature: float | None = Field(default=None, ge=0, le=100, strict=True, allow_inf_nan=False, description="0 = greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1, strict=True, allow_inf_nan=False, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, strict=True, description="Extra field: keep the k most likely tokens (0 = off).")
    n: int = Field(default=1, ge=1, strict=True, description="Number of choices.")
    seed: int | None = Field(default=None, ge=0, strict=True, description="Random seed for reproducible sampling.")
    stream: bool = Field(default=False, strict=True, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="include_usage: a final usage chunk.")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(description="A name for the schema (not used for decoding).")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="The JSON Schema.")
    strict: bool | None = Field(default=None, description="Ignored: the constraint is always strict.")


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON) or ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = Field(description="Format kind.")
    json_schema: JsonSchemaFormat | None = Field(default=None, description="Required for type json_schema.")

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class CompletionRequest(_OpenAIBody):
    """``POST /v1/completions``: OpenAI completions plus ``scenario``, ``structured_outputs``, ``top_k``."""

    prompt: str | list[str] = Field(description="The raw prompt (a list must hold exactly one string).")
    response_format: ResponseFormat | None = Field(default=None, description="One-off JSON constraint.")

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError(f"prompt: a list must hold exactly one string, got {len(self.prompt)}")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = Field(default="{}", description="The arguments as JSON text.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class OpenAIChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is treated as system; tool: a function's result.")
    content: str | list[TextPart] | None = Field(default=None, description="Text, or a list of text parts.")
    tool_calls: list[ToolCall] | None = Field(default=None, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(default=None, description="tool: the call this result answers.")

    def to_chat_message(self) -> ChatMessage:
        """The native message (a developer message is a system message; text parts are joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            extra["tool_call_id"] = self.tool_call_id
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=content, **extra)


class ChatCompletionRequest(_OpenAIBody):
    """``POST /v1/chat/completions``: OpenAI chat completions plus ``scenario``, ``structured_outputs``, ``top_k``."""

    messages: list[OpenAIChatMessage] = Field(min_length=1, description="The conversation.")
    response_format: ResponseFormat | None = Field(default=None, description="One-off JSON constraint.")
    tools: list[Tool] | None = Field(default=None, description="Function tools the model may call.")
    tool_choice: ToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or {type: function, function: {name}}.")
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per answer.")


class _OpenAIResponse(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    scenario: str | None = Field(default=None, description="Extra field: the scenario used.")
    scenario_version: int | None = Field(default=None, description="Extra field: the scenario version pinned.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    attempts: int = Field(default=1, description="Extra field: how many times this output was generated (a JSON "
                                                 "output that fails its schema is generated again).")
    error: str | None = Field(default=None, description="Extra field: why an output ended with finish_reason error.")
    score: float | None = Field(default=None, description="Extra field: num_beams > 1, the score the choice was ranked "
                                                          "by (as /v1/generate's outputs' score); null when sampled.")


class CompletionResponse(_OpenAIResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda value: value is None,
                                              description="The function calls (finish_reason tool_calls).")
    reasoning_content: str | None = Field(default=None, description="Think scenarios: the thinking text.")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    attempts: int = Field(default=1, description="Extra field: how many times this output was generated (a JSON "
                                                 "output that fails its schema is generated again).")
    error: str | None = Field(default=None, description="Extra field: why an output ended with finish_reason error.")
    score: float | None = Field(default=None, description="Extra field: num_beams > 1, the score the choice was ranked "
                                                          "by (as /v1/generate's outputs' score); null when sampled.")


class ChatCompletionResponse(_OpenAIResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "constrained-serve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

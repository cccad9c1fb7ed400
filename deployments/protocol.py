"""What the ingress, the model replicas and the config manager say to each other.

Plain pydantic models and one exception type, no Ray: the ingress validates HTTP bodies into
:class:`GenerateRequest`, a replica answers with :class:`GenerateResponse` (or streams plain dicts:
``token`` events, then ``done`` with the response or ``error``), and any part may raise
:class:`ServiceError`, which the ingress turns into a JSON error with the given HTTP status.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from config.echo import shown_name

__all__ = [
    "ChatMessage",
    "GenerateRequest",
    "GenerateResponse",
    "Output",
    "ServiceError",
    "Usage",
    "check_filter_size",
    "check_request_limits",
    "unwrap_service_error",
]


#: most stop strings per request, and most characters per stop string
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class ServiceError(Exception):
    """An error meant for the client: an HTTP status and a message that names the problem.

    ``detail`` may carry structured data (e.g. the known scenario names for a 404).
    """

    def __init__(self, status: int, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.detail = detail or {}

    def __reduce__(self):  # survive pickling across Ray processes with all fields
        return (ServiceError, (self.status, self.message, self.detail))

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": {"status": self.status, "message": self.message}}
        if self.detail:
            body["error"].update(self.detail)
        return body


def body_too_large(limit_name: str, limit: int) -> ServiceError:
    """The 413 of a request body over ``limit`` bytes, naming the ``Limits`` field (``max_body_bytes``, or
    ``max_upload_bytes`` for a catalog upload): the body size middleware, the streamed upload and its spool say it
    alike."""
    return ServiceError(413, f"request body: more than {limit} bytes exceeds the limit {limit_name}={limit}",
                        {"field": "body", "limit_name": limit_name, "limit": limit})


def check_request_limits(
    limits,
    *,
    max_new_tokens: int | None = None,
    n: int | None = None,
    num_beams: int | None = None,
    seed: int | None = None,
    exclude: list | None = None,
    rename: dict[str, str] | None = None,
    item_filter: Any = None,
) -> None:
    """422 naming the field when a request asks for more than ``limits`` (a ``config.Limits``) allows.

    ``exclude``: at most ``max_exclude_items`` items, and a tree item of at most ``max_new_tokens`` token ids (a
    longer item can never be produced): checked with the request, before it goes to a replica (an item of
    millions of ids used to travel to the replica and be walked there).

    The ingress checks what a client sent; a replica checks again what it will run (it can be called
    without the ingress), with the scenario's defaults applied. ``rename`` maps our field names to
    the client's (e.g. ``max_new_tokens`` -> ``max_tokens`` on the OpenAI routes).
    """
    from config.settings import MAX_SEED

    rename = rename or {}
    for field, value, limit_name in (
        ("max_new_tokens", max_new_tokens, "max_new_tokens"),
        # a beam request's n is bounded by its num_beams (checked with the request), sampled rows by max_n
        ("n", n, "max_num_beams" if num_beams is not None and num_beams > 1 else "max_n"),
        ("num_beams", num_beams, "max_num_beams"),
    ):
        limit = getattr(limits, limit_name)
        if value is not None and value > limit:
            name = rename.get(field, field)
            raise ServiceError(
                422, f"{name}: {value} exceeds the limit {limit_name}={limit}",
                {"field": name, "limit_name": limit_name, "limit": limit},
            )
    if seed is not None and seed > MAX_SEED:
        raise ServiceError(422, f"seed: {seed} is above the largest seed, {MAX_SEED} (2**63 - 1)", {"field": "seed"})
    if item_filter is not None:
        check_filter_size(item_filter, limits)
    if exclude is not None:
        if len(exclude) > limits.max_exclude_items:
            raise ServiceError(
                422, f"exclude: {len(exclude)} items exceeds the limit max_exclude_items={limits.max_exclude_items}",
                {"field": "exclude", "limit_name": "max_exclude_items", "limit": limits.max_exclude_items},
            )
        longest = limits.max_new_tokens
        for i, item in enumerate(exclude):
            if isinstance(item, (list, tuple)) and len(item) > longest:
                raise ServiceError(
                    422, f"exclude[{i}]: {len(item)} token ids exceeds the limit max_new_tokens={longest}: an item "
                         "longer than the most tokens a request may generate can never be produced",
                    {"field": f"exclude[{i}]", "limit_name": "max_new_tokens", "limit": longest},
                )


def check_filter_size(value: Any, limits) -> None:
    """A request's ``filter`` bounded by its shape before it goes to a replica (which reads it against the
    catalog's fields: ``processors/kinds/tree/filters/language.py``): nesting past ``max_filter_depth`` levels of ``$and`` /
    ``$or`` or more JSON values than ``max_filter_clauses`` conditions of ``max_filter_values`` values could hold
    is a 422 naming the limit; an integer no float holds (a JSON number of 400 digits: a filter compares
    finite numbers) is a 422 naming its path (``filter.stock.$gt``). One pass with a stack, stopped at the bound
    (never recursion)."""
    if not isinstance(value, dict):
        raise ServiceError(422, f"filter: expected a JSON object of field conditions, got {type(value).__name__}",
                           {"field": "filter"})
    max_levels = 2 * limits.max_filter_depth + 2  # each $and / $or level is a list and an object; a field's operators
    max_nodes = limits.max_filter_clauses * (limits.max_filter_values + 8)
    # each entry: (node, level, where): where is "filter" or (the parent's where, the key or index), a path made
    # only for an error
    stack: list[tuple[Any, int, Any]] = [(value, 1, "filter")]
    nodes = 0
    while stack:
        node, level, where = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ServiceError(422, f"filter: more than {max_nodes} JSON values, over what max_filter_clauses="
                                    f"{limits.max_filter_clauses} conditions of max_filter_values="
                                    f"{limits.max_filter_values} values hold", {"field": "filter",
                                    "limit_name": "max_filter_clauses", "limit": limits.max_filter_clauses})
        if level > max_levels:
            raise ServiceError(422, f"filter: nested deeper than max_filter_depth={limits.max_filter_depth} levels "
                                    "of $and / $or", {"field": "filter", "limit_name": "max_filter_depth",
                                                      "limit": limits.max_filter_depth})
        if isinstance(node, dict):
            stack.extend((child, level + 1, (where, key)) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, level + 1, (where, i)) for i, child in enumerate(node))
        elif isinstance(node, int) and not isinstance(node, bool) and not _float_holds(node):
            path = _filter_path(where)
            raise ServiceError(422, f"{path}: an integer past the largest float (about 1.8e308); a filter compares "
                                    "finite numbers", {"field": path})


def _float_holds(number: int) -> bool:
    try:
        float(number)
    except OverflowError:
        return False
    return True


def _filter_path(where: Any) -> str:
    """The path of a filter's value (``filter.$or[0].stock.$gt``, as the replica names it) from the ``(parent,
    key)`` links of :func:`check_filter_size`'s walk; a key shown bounded (:func:`config.echo.shown_name`)."""
    parts: list[str] = []
    while isinstance(where, tuple):
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{shown_name(key)}")
    return where + "".join(reversed(parts))


def unwrap_service_error(exc: BaseException) -> ServiceError | None:
    """The :class:`ServiceError` behind ``exc`` (Ray wraps exceptions raised in other processes)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ServiceError):
            return ServiceError(exc.status, exc.message, exc.detail)
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _none(value: Any) -> bool:
    return value is None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"] = Field(
        description="Who wrote the message (tool: a function's result, see tool_call_id).")
    content: str = Field(description="The message text.")
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, exclude_if=_none,
        description="assistant: the function calls it made (OpenAI's shape: id, type, function.name, "
                    "function.arguments).",
    )
    tool_call_id: str | None = Field(default=None, exclude_if=_none, description="tool: the call this result answers.")


class GenerateRequest(_Strict):
    """One generation request, as the replicas receive it (validated by the ingress).

    Exactly one of ``scenario`` (a stored scenario name) or ``inline_scenario`` (a one-off scenario
    body, e.g. from an OpenAI ``response_format``) may be set; neither means unconstrained.
    Sampling fields left ``None`` take the scenario's defaults, then the server's.
    """

    #: the client that sent it, as the ingress's per-client bounds count it (``InflightPerClient``); set by the
    #: ingress (``hold_rows``), carried to the replica with the request, never part of the API
    _client: str | None = PrivateAttr(default=None)

    scenario: str | None = Field(default=None, description="Name of a stored scenario.")
    inline_scenario: dict[str, Any] | None = Field(
        default=None, description="A one-off scenario body (same format as a stored scenario)."
    )
    prompt: str | None = Field(default=None, description="Raw prompt text (no chat template).")
    messages: list[ChatMessage] | None = Field(default=None, description="Chat messages (chat template applied).")
    tools: list[dict[str, Any]] | None = Field(
        default=None, exclude_if=_none,
        description="Function tools (OpenAI's shape) for the prompt: given to a chat template that takes tools, "
                    "else listed in a system message (processors/tool_prompt.py). They do not constrain the output.",
    )
    # strict: true is not 1 and "3" is not 3 (booleans, numbers and strings do not stand in for each other);
    # floats must be finite (NaN and infinities are refused).
    max_new_tokens: int | None = Field(default=None, ge=1, strict=True, description="Most tokens to generate per output.")
    temperature: float | None = Field(default=None, ge=0, le=100, strict=True, allow_inf_nan=False, description="0 = greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1, strict=True, allow_inf_nan=False, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, strict=True, description="Keep the k most likely tokens (0 = off).")
    n: int = Field(default=1, ge=1, strict=True, description="Number of outputs (sampled independently).")
    num_beams: int = Field(default=1, ge=1, strict=True, description="Beam search width (1 = no beam search).")
    seed: int | None = Field(default=None, ge=0, strict=True, description="Random seed for reproducible sampling.")
    stream: bool = Field(default=False, strict=True, description="Stream tokens as server-sent events.")
    exclude: list[list[Annotated[int, Field(strict=True)]] | str] | None = Field(
        default=None,
        description="tree and labels scenarios: items that must not be produced. A tree item is the list of token "
                    "ids after the root up to its end (without the end token); a label item is the label. An item "
                    "that is not in the scenario is a 422 naming exclude[i]. At most the limit max_exclude_items "
                    "items, each tree item at most the limit max_new_tokens token ids (a longer one can never be "
                    "produced; a 422 naming exclude[i] before the request reaches a model replica).",
    )
    distinct: bool = Field(
        default=False, strict=True,
        description="tree and labels scenarios: the n outputs (or returned beams) are different items.",
    )
    filter: dict[str, Any] | None = Field(
        default=None,
        description="tree catalogs with item metadata: only items whose metadata pass this filter are produced, in "
                    "the vector databases' filter language: {\"region\": {\"$in\": [\"eu\"]}, \"stock\": {\"$gt\": "
                    "0}} ($eq $ne $in $nin $contains $not_contains $gt $gte $lt $lte $and $or; fields side by side "
                    "must all hold; a list field matches $eq / $in when any of its strings does, and $contains is "
                    "$eq of one value, as in Chroma). A field "
                    "the catalog does not have, an unknown operator or a value of the wrong kind is a 422 naming the "
                    "field; a filter no item passes is a 422 saying so. Bounded by max_filter_clauses, "
                    "max_filter_depth and max_filter_values.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] | None = Field(
        default=None, max_length=MAX_STOP_STRINGS,
        description="Stop strings: an output ends before the first of them it produces (finish_reason stop; the "
                    "string itself is not returned).",
    )

    logprobs: int | None = Field(
        default=None, ge=0, le=20, strict=True,
        description="Log probabilities of the output tokens under the model (before any constraint), with this many "
                    "most likely alternatives per token (0: the chosen token only); null: none.",
    )

    @model_validator(mode="after")
    def _check(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.scenario is not None and self.inline_scenario is not None:
            raise ValueError("give at most one of 'scenario' or 'inline_scenario'")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise ValueError("'n' must not exceed 'num_beams' with beam search")
        if self.num_beams > 1 and self.stream:
            raise ValueError("beam search cannot be streamed")
        return self


def _absent(value: Any) -> bool:
    return value is None


class Output(BaseModel):
    text: str = Field(description="The generated text (special tokens removed).")
    token_ids: list[int] = Field(description="The generated token ids, including the end token if any.")
    finish_reason: Literal["stop", "length", "error"] = Field(
        description="stop: the row emitted its end token; length: max_new_tokens reached; error: see 'error'."
    )
    error: str | None = Field(default=None, description="Why the row failed, when it did.")
    attempts: int = Field(
        default=1, description="How many times this output was generated: a JSON output that failed validation "
                               "against its schema is generated again (json_regenerate_attempts).",
    )
    score: float | None = Field(
        default=None,
        description="Beam search (num_beams > 1): the score the output was ranked by, outputs best first: the sum of "
                    "its tokens' log-probabilities (the model's distribution masked by the constraint, the end token "
                    "included) divided by its number of tokens; at most 0. HF generate's sequences_scores "
                    "(length_penalty 1). null for sampled outputs.",
    )
    # present only when they apply (think scenarios; logprobs asked for)
    reasoning_content: str | None = Field(
        default=None, exclude_if=_absent, description="Think scenarios: the thinking text (before the end marker)."
    )
    answer: str | None = Field(default=None, exclude_if=_absent, description="Think scenarios: the text after the end marker.")
    logprobs: list[dict[str, Any]] | None = Field(
        default=None, exclude_if=_absent,
        description="When asked: per output token, {token_id, token, logprob, top: [{token_id, token, logprob}]} "
                    "(log probabilities of the model before any constraint).",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    scenario: str | None = Field(description="The scenario name (None for unconstrained or one-off).")
    version: int | None = Field(description="The scenario version this request was pinned to.")
    outputs: list[Output]
    usage: Usage
    tool_plan: dict[str, Any] | None = Field(
        default=None, exclude_if=_absent,
        description="A stored tool set (tools scenario) only: how its outputs are read as tool calls on the chat and "
                    "Responses routes, from the version that decoded them: {mode, names, parallel}.",
    )

"""The replica's request handling: a request resolved to its scenario, admitted, decoded and answered.

:class:`RequestHandler` turns a :class:`~deployments.protocol.GenerateRequest` into an engine request (the scenario
it pins, its answer form, prompt ids, sampling, item controls, the engine's admission), runs it (every finished
JSON output checked, ``regenerate.py``; stop strings, ``stops.py``) and builds the response or the stream's events.
A request pins the compiled scenario it was admitted with, so a new version never changes a request in flight.
What it asks of a scenario's kind goes through the kind's hooks (:class:`processors.kinds.base.ConstraintKind`); the
served scenarios come from a :class:`ScenarioSource` (the replica's
:class:`~deployments.replica.subscriber.ScenarioSubscriber`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Protocol

from config import ScenarioError, ServerSettings
from processors import CompiledScenario, ScenarioCompiler, build_prompt_ids
from processors.compile import PromptTooLong

from ..engines import (
    DoneEvent, EngineRequest, ErrorEvent, FinishedEvent, SamplingParams, TokenEvent,
)
from .answer import answer_form, split_thinking
from .item_controls import admit_item_controls
from .prompt_bounds import prompt_too_long
from ..metrics import ReplicaMetrics
from .regenerate import CheckedRun
from .stops import _Stops, free_text_stops
from ..protocol import GenerateRequest, GenerateResponse, Output, ServiceError, Usage, check_request_limits
from ..scenario_errors import scenario_service_error

logger = logging.getLogger(__name__)

try:  # chat templates are jinja2 templates; transformers needs jinja2 to apply them
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover
    TemplateError = ValueError

__all__ = ["RequestHandler", "ScenarioSource", "output_plan"]


def output_plan(compiled: CompiledScenario | None) -> dict[str, Any] | None:
    """How the OpenAI routes read the scenario's outputs (a stored tool set's calls), from its kind
    (:meth:`~processors.kinds.base.ConstraintKind.output_plan`); None: as text."""
    if compiled is None or compiled.extras is None:
        return None
    kind = compiled.constraint_kind
    return kind.output_plan(compiled.extras) if kind is not None else None


class ScenarioSource(Protocol):
    """The scenarios a replica serves, as the request handler reads them."""

    def scenario(self, name: str) -> tuple[int, CompiledScenario] | None:
        """The served ``(version, compiled)`` of ``name``, or None."""
        ...

    def served(self) -> dict[str, tuple[int, CompiledScenario]]:
        """Every served scenario by name (the mapping in place now)."""
        ...


class RequestHandler:
    """``generate`` / ``generate_stream`` of a replica (held by
    :class:`~deployments.replica.model_replica.ModelReplica` as ``replica.requests``).

    Args:
        scenarios: the served scenarios (the replica's :class:`~deployments.replica.subscriber.ScenarioSubscriber`).
        settings: the replica's :class:`config.ServerSettings` (limits, JSON regeneration, special tokens).
        model, tokenizer, engine: the replica's model (logprobs scored with it), tokenizer and decode engine.
        metrics: the replica's :class:`~deployments.metrics.ReplicaMetrics` (one record per request).
        compiler: the one-off constraints' :class:`processors.ScenarioCompiler`.
        max_token_bytes: the longest token's bytes (a prompt too long by its bytes is a 413 before tokenizing).
    """

    def __init__(self, scenarios: ScenarioSource, *, settings: ServerSettings, model: Any, tokenizer: Any, engine: Any,
                 metrics: ReplicaMetrics, compiler: ScenarioCompiler, max_token_bytes: int):
        self.scenarios = scenarios
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics
        self._compiler = compiler
        self.max_token_bytes = max_token_bytes

    async def _resolve_scenario(self, req: GenerateRequest) -> tuple[str | None, int | None, CompiledScenario | None]:
        if req.scenario is not None:
            entry = self.scenarios.scenario(req.scenario)
            if entry is None:
                raise ServiceError(404, f"unknown scenario {req.scenario!r}", {"known": sorted(self.scenarios.served())})
            return req.scenario, entry[0], entry[1]
        if req.inline_scenario is not None:
            try:  # the same limits and messages as a stored scenario; a tree file is for stored scenarios only
                compiled = await self._compiler.prepare(req.inline_scenario, one_off=True, field="inline_scenario")
            except ScenarioError as exc:
                raise scenario_service_error(exc, "constraint") from None
            return None, None, compiled
        return None, None, None

    def _job_params(self, req: GenerateRequest, compiled: CompiledScenario | None,
                    checked: bool = False) -> tuple[int, SamplingParams]:
        """``checked``: the request's own limits were checked (by the ingress); a default is checked here."""
        limits = self.settings.limits
        defaults = compiled.settings if compiled is not None else {}
        max_new = req.max_new_tokens or defaults.get("max_new_tokens") or limits.default_max_new_tokens
        if not (checked and req.max_new_tokens):
            check_request_limits(limits, max_new_tokens=max_new)  # with the scenario's default applied
        pick = lambda name, fallback: getattr(req, name) if getattr(req, name) is not None else defaults.get(name, fallback)  # noqa: E731
        return max_new, SamplingParams(
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=int(pick("top_k", 0)),
            seed=req.seed,
        )

    async def _start(self, request: dict | GenerateRequest) -> tuple[GenerateRequest, str | None, int | None, list[int], EngineRequest]:
        """A :class:`GenerateRequest` is one the ingress validated and checked against the limits: only what this
        replica alone knows is checked here (the scenario, its defaults, the prompt's length, memory). A dict (a
        caller without the ingress) is validated and checked first."""
        limits = self.settings.limits
        checked = isinstance(request, GenerateRequest)
        if checked:
            req = request
        else:
            try:
                req = GenerateRequest.model_validate(request)
            except Exception as exc:
                raise ServiceError(422, f"invalid request: {exc}") from None
            check_request_limits(limits, n=req.n, num_beams=req.num_beams, seed=req.seed, exclude=req.exclude,
                                 item_filter=req.filter)
        if req.messages is not None and not req.messages:
            raise ServiceError(422, "messages: give at least one message", {"field": "messages"})
        name, version, compiled = await self._resolve_scenario(req)
        if req.tools and output_plan(compiled) is not None:  # a scenario read as calls brings its own tools
            raise ServiceError(400, f"tools: scenario {name!r} is a stored tool set (type {compiled.kind}), which brings its own "
                                    "tools; give either tools or that scenario", {"field": "tools", "param": "tools",
                                                                                 "type": "invalid_request_error"})
        # a label scenario's answer tokenized as it fits the prompt (no leading space after an assistant header)
        compiled = answer_form(compiled, chat=req.messages is not None, prompt=req.prompt)
        # off the event loop: rendering and tokenizing are linear but slow (the replica keeps answering pings)
        prompt_ids = await asyncio.to_thread(self._prompt_ids, req, compiled)
        max_new, sampling = self._job_params(req, compiled, checked)
        # exclude, distinct, budget; a filter (the request's, the scenario's) resolved once per filter and version,
        # off the event loop
        filtered = req.filter is not None or (compiled is not None and "filter" in compiled.settings)
        if filtered and not self.engine.item_filters:
            raise ServiceError(422, "filter: not served by this replica's engine yet (engine: transformers serves "
                                    "it)", {"field": "filter"})
        items = (await asyncio.to_thread(admit_item_controls, req, compiled, max_new, limits) if filtered else
                 admit_item_controls(req, compiled, max_new, limits))
        engine_request = EngineRequest(prompt_ids=prompt_ids, compiled=compiled, max_new_tokens=max_new,
                                       sampling=sampling, n=req.n, num_beams=req.num_beams, items=items,
                                       logprobs=req.logprobs if self.engine.reports_logprobs else None,
                                       client=req._client)
        too_large = self.engine.admission_error(engine_request)
        if too_large is not None:
            raise ServiceError(422, too_large, {"field": "num_beams" if req.num_beams > 1 else "n",
                                                "limit_name": "kv_memory_mb"})
        logger.info("generate scenario=%s version=%s n=%d beams=%d prompt_tokens=%d", name, version, req.n, req.num_beams,
                    len(prompt_ids), extra={"scenario": name, "scenario_version": version})
        return req, name, version, prompt_ids, engine_request

    def _prompt_ids(self, req: GenerateRequest, compiled: CompiledScenario | None) -> list[int]:
        """The request's prompt tokens (run in a worker thread). A text that cannot fit in ``max_prompt_tokens`` by
        its length in bytes (over ``max_prompt_tokens * max_token_bytes``) is a 413 before it is tokenized; then
        the token count is checked."""
        limit = self.settings.limits.max_prompt_tokens
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        try:
            prompt_ids = build_prompt_ids(compiled, self.tokenizer, prompt=req.prompt, messages=messages,
                                          special_tokens_in_content=self.settings.allow_special_tokens_in_content,
                                          tools=req.tools, max_text_bytes=limit * self.max_token_bytes)
        except PromptTooLong as exc:
            raise prompt_too_long(exc.text_bytes, limit, self.max_token_bytes) from None
        except (ValueError, TemplateError) as exc:  # e.g. the chat template refuses the messages
            field = "messages" if messages is not None else "prompt"
            raise ServiceError(422, f"{field}: cannot build the prompt: {exc}", {"field": field}) from None
        if not prompt_ids:
            raise ServiceError(422, "the prompt is empty")
        if len(prompt_ids) > limit:
            raise ServiceError(
                413, f"prompt: {len(prompt_ids)} tokens exceeds the limit max_prompt_tokens={limit}",
                {"field": "prompt", "limit_name": "max_prompt_tokens", "limit": limit},
            )
        return prompt_ids

    def _checked(self, engine_request: EngineRequest) -> CheckedRun:
        """The engine's events for ``engine_request``, each finished JSON output validated against its schema
        and generated again when it fails (``deployments/replica/regenerate.py``)."""
        return CheckedRun(self.engine, engine_request, self.tokenizer, self.settings.json_regenerate_attempts,
                          self.settings.json_regenerate_budget)

    def _response(self, name, version, prompt_ids, outputs: dict[int, FinishedEvent], compiled=None,
                  stopped: dict[int, str] | None = None, rejected_tokens: int = 0) -> GenerateResponse:
        """``stopped``: the final text of outputs ended by a stop string; ``compiled``: think scenarios split
        their text into ``reasoning_content`` and ``answer``; ``rejected_tokens``: tokens of JSON attempts that
        were generated again (:class:`CheckedRun`), counted in ``usage.completion_tokens`` with the outputs'."""
        outs = []
        completion = rejected_tokens
        think = getattr(compiled, "think", None)
        for index in sorted(outputs):
            ev = outputs[index]
            ids = ev.token_ids
            completion += len(ids)
            text = (stopped or {}).get(index)
            if text is None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            reasoning, answer = split_thinking(text, think.end) if think is not None else (None, None)
            outs.append(Output(
                text=text, token_ids=ids, finish_reason=ev.finish_reason, error=ev.error,
                attempts=getattr(ev, "attempts", 1), score=ev.score,
                reasoning_content=reasoning, answer=answer,
            ))
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion, total_tokens=len(prompt_ids) + completion)
        plan = output_plan(compiled)  # a stored tool set: read as calls with this version's tools
        return GenerateResponse(scenario=name, version=version, outputs=outs, usage=usage, tool_plan=plan)

    async def generate(self, request: dict | GenerateRequest) -> dict | GenerateResponse:
        """Run one request to completion. Given a :class:`GenerateRequest` (the ingress), returns the
        :class:`GenerateResponse`; given a dict, the response as a dict."""
        with self.metrics.request(request, self.scenarios.served()) as record:
            return await self._generate(request, record)

    async def _generate(self, request: dict | GenerateRequest, record) -> dict | GenerateResponse:
        req, name, version, prompt_ids, engine_request = await self._start(request)
        outputs: dict[int, FinishedEvent] = {}
        # the engine's own ends: where it reports logprobs, an output cut by a stop string takes its first tokens'
        engine_ends: dict[int, FinishedEvent] = {}
        engine_logprobs = engine_request.logprobs is not None
        stops = _Stops(self.tokenizer, free_text_stops(req.stop, engine_request.compiled))  # free text only
        run = self._checked(engine_request)
        async with aclosing(run.events()) as events:  # leaving early cancels
            async for ev in events:
                if isinstance(ev, TokenEvent) and stops.active:
                    stops.token(ev.index, ev.token_id, outputs)
                    # every output ended (some by a stop string): cancel what still decodes (a beam request has
                    # nothing left to decode once its tokens come; its outputs' scores follow)
                    if len(outputs) == engine_request.n and not engine_logprobs and engine_request.num_beams == 1:
                        break
                elif isinstance(ev, FinishedEvent):
                    engine_ends[ev.index] = ev
                    cut = outputs.setdefault(ev.index, ev)
                    if cut is not ev and ev.score is not None:  # a beam cut by a stop string keeps its beam's score
                        outputs[ev.index] = dataclasses.replace(cut, score=ev.score)
                elif isinstance(ev, DoneEvent):
                    break
                elif isinstance(ev, ErrorEvent):
                    raise ServiceError(500, ev.message)
        record.outputs(outputs)
        response = self._response(name, version, prompt_ids, outputs, engine_request.compiled, stops.final,
                                  run.rejected_tokens)
        if req.logprobs is not None:
            await self._add_logprobs(response, prompt_ids, req.logprobs, engine_request.compiled,
                                     engine_ends if engine_logprobs else None)
        return response if isinstance(request, GenerateRequest) else response.model_dump()

    async def _add_logprobs(self, response: GenerateResponse, prompt_ids: list[int], top: int, compiled,
                            reported: dict[int, FinishedEvent] | None = None) -> None:
        """Fill each output's ``logprobs``. ``reported``: the engine's finished outputs, whose ``logprobs`` are the
        distribution each token was sampled from, after the constraint's mask (``engine: vllm``); otherwise one
        forward pass over prompt + output, the model's own distribution (before the constraint masks it, as vLLM
        reports by default). The end token is not counted."""
        ends = set(compiled.stop_token_ids) if compiled is not None else set()
        ends.update(t for t in [getattr(self.tokenizer, "eos_token_id", None)] if t is not None)
        text = lambda t: self.tokenizer.decode([int(t)], skip_special_tokens=False)  # noqa: E731
        if reported is not None:
            for index, output in enumerate(response.outputs):
                ev = reported.get(index)
                given = (ev.logprobs or []) if ev is not None else []
                ids = list(output.token_ids)
                while ids and ids[-1] in ends:
                    ids = ids[:-1]
                output.logprobs = [
                    {"token_id": token_id, "token": text(token_id), "logprob": lp,
                     "top": [{"token_id": t, "token": text(t), "logprob": v} for t, v in alts]}
                    for token_id, lp, alts in given[:len(ids)]
                ]
            return
        if getattr(self.model, "forward", None) is None:
            raise ServiceError(400, f"logprobs: not available with engine {self.engine.name}", {"field": "logprobs"})

        def score(ids: list[int]) -> list[dict[str, Any]]:
            import torch

            while ids and ids[-1] in ends:
                ids = ids[:-1]
            if not ids:
                return []
            device = getattr(self.model, "device", "cpu")
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([prompt_ids + ids], device=device)).logits[0]
            logp = torch.log_softmax(logits[len(prompt_ids) - 1: -1].float(), dim=-1)
            chosen = logp.gather(1, torch.tensor(ids, device=logp.device)[:, None])[:, 0].tolist()
            best = torch.topk(logp, top, dim=-1) if top else None
            items = []
            for i, (token_id, lp) in enumerate(zip(ids, chosen)):
                alts = [] if best is None else [
                    {"token_id": int(t), "token": text(t), "logprob": float(v)}
                    for t, v in zip(best.indices[i].tolist(), best.values[i].tolist())
                ]
                items.append({"token_id": int(token_id), "token": text(token_id), "logprob": float(lp), "top": alts})
            return items

        for output in response.outputs:
            output.logprobs = await asyncio.to_thread(score, list(output.token_ids))

    async def generate_stream(self, request: dict | GenerateRequest) -> AsyncIterator[dict]:
        """Yield event dicts: ``token`` events as tokens are sampled, then ``done`` with the response (or ``error``)."""
        with self.metrics.request(request, self.scenarios.served()) as record:
            async with aclosing(self._generate_stream(request, record)) as stream:
                async for event in stream:
                    yield event

    async def _generate_stream(self, request: dict | GenerateRequest, record) -> AsyncIterator[dict]:
        req, name, version, prompt_ids, engine_request = await self._start(request)
        outputs: dict[int, FinishedEvent] = {}
        texts: dict[int, list[int]] = {}
        sent: dict[int, str] = {}
        stops = _Stops(self.tokenizer, free_text_stops(req.stop, engine_request.compiled))  # free text only
        think = getattr(engine_request.compiled, "think", None)
        split_sent: dict[int, tuple[str, str]] = {}
        tool_set = output_plan(engine_request.compiled) is not None

        def event(idx: int, token_id: int | None, piece: str, visible: str, final: bool, **extra: Any) -> dict:
            """A token event; think scenarios add the piece's thinking and answer parts."""
            out = {"type": "token", "index": idx, "token_id": token_id, "text": piece, **extra}
            if tool_set:  # a stored tool set: the OpenAI routes send the output as calls once it is finished
                out["tool_call"] = True
            if think is not None:
                reasoning, answer = split_thinking(visible, think.end, final=final)
                r_sent, a_sent = split_sent.get(idx, ("", ""))
                out["reasoning"], out["answer"] = reasoning[len(r_sent):], answer[len(a_sent):]
                split_sent[idx] = (reasoning, answer)
            return out

        run = self._checked(engine_request)
        try:
            async with aclosing(run.events()) as events:  # leaving early cancels
                async for ev in events:
                    if isinstance(ev, TokenEvent):
                        idx = ev.index
                        if idx in outputs:
                            continue  # ended by a stop string
                        toks = texts.setdefault(idx, [])
                        toks.append(ev.token_id)
                        piece = stops.piece(idx, ev.token_id, toks, outputs)
                        if piece is None:  # an incomplete UTF-8 sequence: wait for the next token
                            yield event(idx, ev.token_id, "", sent.get(idx, ""), False)
                            continue
                        visible = sent[idx] = sent.get(idx, "") + piece
                        yield event(idx, ev.token_id, piece, visible, False)
                        if idx in outputs:  # a stop string ended it
                            yield event(idx, None, "", visible, True, finish_reason="stop")
                            if len(outputs) == engine_request.n:
                                resp = self._response(name, version, prompt_ids, outputs, engine_request.compiled, stops.final,
                                                      run.rejected_tokens)
                                yield {"type": "done", "index": 0, "response": resp.model_dump()}
                                return
                    elif isinstance(ev, FinishedEvent):
                        if ev.index in outputs:
                            continue
                        outputs[ev.index] = ev
                        # the whole text now: a tail held back (it might have become a stop string) is sent
                        final, before = self.tokenizer.decode(ev.token_ids, skip_special_tokens=True), sent.get(ev.index, "")
                        piece = final[len(before):] if final.startswith(before) else ""
                        yield event(ev.index, None, piece, final, True, finish_reason=ev.finish_reason)
                    elif isinstance(ev, DoneEvent):
                        resp = self._response(name, version, prompt_ids, outputs, engine_request.compiled, stops.final,
                                              run.rejected_tokens)
                        yield {"type": "done", "index": 0, "response": resp.model_dump()}
                        return
                    elif isinstance(ev, ErrorEvent):
                        record.failed = True
                        yield {"type": "error", "index": 0, "error": ev.message}
                        return
        finally:
            record.outputs(outputs)

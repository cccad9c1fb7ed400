"""Our processor chain as a vLLM logits processor (the batch-level V1 interface).

vLLM builds one :class:`ChainLogitsProcessor` per model runner (in its worker process) when the engine is
created with ``logits_processors=[FQCN]``. A request that carries ``SamplingParams.extra_args[EXTRA_KEY]``
(``{"key": <CompiledScenario.version>, "path": <pickle file>}``) gets a :class:`processors.RowCursor` when it
joins the persistent batch (``update_state``: added / removed / moved rows); every step ``apply`` first
advances each cursor by the row's new output tokens (vLLM hands over a live reference to each request's
output ids) and then masks the batch's logits with :func:`processors.apply_steps`, one call for all rows,
whatever their scenarios. Rows without the key are left alone. An entry may also carry ``"scale"``: vLLM
accepts temperatures up to 2 only, so a row sampled at ``T > 2`` runs at 2 with its logits multiplied by
``2 / T`` here (after the mask): the same distribution as dividing by ``T``.

The compiled scenario travels as a file, not inside the request: the replica (:mod:`.handoff`) pickles each
scenario version once into a directory of its own and names it by its content hash; the processor loads a
version the first time a row needs it and keeps the last :data:`CACHE_SIZE` in memory. A request keeps the
version it was admitted with: a new version is a new key.

A cursor that raises forces its row's end token (the replica's replay of the same tokens reports the
failure, see :mod:`.engine`); one row's failure never touches another row.

Grammar masks (json, json_schema, regex, grammar, tools) are computed by a
:class:`processors.mask_budget.MaskBudget` (``mask_step_budget_ms``, from :data:`.handoff.BUDGET_ENV`): the step's
due masks in parallel on threads, each within the budget; a row whose mask is late is expired (its end token only,
from then on) and the replica's replay reports it as an ``error`` naming the setting. vLLM samples every row of its
batch in each step, so a row cannot sit out a step as in the transformers engine: the others wait for a slow mask,
at most the budget.

Item controls (``exclude``, ``distinct``): an entry's ``"items"`` (:func:`.params.item_extra`) binds the row's
cursor to its request's :class:`processors.items.ItemRequest`, one per request of ours in this worker, shared by
the request's rows (:mod:`.item_groups`: built when the first row joins, released when the rows end). Rows of a
``distinct`` request that decode together have their tokens drawn here, one after the other (see there). The
token budget (``max_tokens``) and a scenario's multi-item rules bind every tree and label row.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from processors import RowCursor, apply_steps
from processors.base import as_ids
from processors.lanes import advance_rows, lane_of, mask_rows
from processors.mask_budget import SETTING, MaskBudget
from processors.masks import ALLOW, FREE, MaskBuffer, Step, mask_padded_vocab

from .handoff import BUDGET_ENV, EXTRA_KEY, OWNER_ENV, load_compiled
from .item_groups import ItemGroups, draw, row_generator, row_sampling

if TYPE_CHECKING:  # pragma: no cover
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

__all__ = ["CACHE_SIZE", "ChainLogitsProcessor", "FQCN"]

#: how vLLM finds this class (``logits_processors=[FQCN]``)
FQCN = "deployments.engines.vllm.processor:ChainLogitsProcessor"
#: compiled scenario versions kept in memory per worker
CACHE_SIZE = 64

_FREE = Step(FREE, None, 0)
#: set to 1 in the replica's environment (which vLLM's worker inherits) to mask and advance the tree and single-label
#: rows through processors.lanes (off by default: slower than the per-row path on CPU below batch ~64, see README)
LANE_ENV = "CONSTRAINED_SERVE_VECTOR_LANE"


class _StepRow:
    """A row of the batch for :func:`processors.lanes.mask_rows` whose step is already known (per-row path)."""

    __slots__ = ("_step",)
    _lane_code = 0  # processors.lanes.OFF: the per-row path

    def __init__(self, step: Step):
        self._step = step

    def step(self) -> Step:
        return self._step


_FREE_ROW = _StepRow(_FREE)


class _Row:
    __slots__ = ("cursor", "output_ids", "consumed", "broken", "scale", "group", "distinct", "ahead", "max_tokens",
                 "sampling", "generator")

    def __init__(self, cursor: RowCursor | None, output_ids: list[int], scale: float | None = None):
        self.cursor = cursor  # None: a row that only needs its logits scaled
        self.scale = scale
        self.output_ids = output_ids  # vLLM's live list of the request's output tokens
        self.consumed = 0
        self.broken: Step | None = None  # set once the cursor raised: the end token only, from then on
        self.group: str | None = None  # our request's id, for rows with item controls (.item_groups)
        self.distinct = False
        self.ahead: int | None = None  # a token drawn here and already advanced, not yet in output_ids
        self.max_tokens: int | None = None
        self.sampling = self.generator = None  # distinct rows: their own draw (.item_groups.draw)


class ChainLogitsProcessor(LogitsProcessor):
    """Masks each constrained row of vLLM's batch with that row's own :class:`processors.RowCursor`."""

    def __init__(self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool):
        self.device = device
        self._mask_buffer = MaskBuffer(device, pin=bool(is_pin_memory) and torch.device(device).type == "cuda")
        self.rows: dict[int, _Row] = {}
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._tokenizer_path = vllm_config.model_config.tokenizer
        self.vocab_size: int | None = None
        self.stats = {"rows": 0, "steps": 0, "chain_seconds": 0.0, "loads": 0, "failed_rows": 0, "drawn": 0,
                      "late_rows": 0}
        self.groups = ItemGroups()
        self.budget = MaskBudget(_budget_ms())
        self.vector_lane = os.environ.get(LANE_ENV) == "1"
        watch_owner()
        try:  # grammar rows need the tokenizer (and its llguidance form): build both now, not at a first request
            self._load_tokenizer()
        except Exception:  # pragma: no cover - a grammar row retries and reports it
            logger.warning("could not load the tokenizer for grammar rows at start", exc_info=True)

    # -- vLLM interface ---------------------------------------------------------------------------
    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        extra = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if extra is None:
            return
        ok = isinstance(extra, dict) and (
            ("key" not in extra and "path" not in extra)
            or (isinstance(extra.get("key"), str) and isinstance(extra.get("path"), str))
        )
        scale = extra.get("scale") if isinstance(extra, dict) else None
        if not ok or (scale is not None and not (isinstance(scale, float) and 0 < scale <= 1)):
            raise ValueError(f"extra_args[{EXTRA_KEY!r}] must be {{'key': str, 'path': str, 'scale': float in (0, 1]}} "
                             "(key and path together or neither, each part optional)")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is the most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        if self.groups.groups:  # rows with item controls that leave (a reused slot's row has left too)
            for index in batch_update.removed:
                self._leave(self.rows.get(index))
            for added in batch_update.added:
                self._leave(self.rows.get(added[0]))
        process_dict_updates(self.rows, batch_update, self._safe_new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        t0 = time.perf_counter()
        if self.vector_lane and not self.groups.groups:
            return self._apply_lane(logits, t0)
        n = logits.shape[0]
        self._settle_masks(n)
        steps = [_FREE] * n
        scaled: list[tuple[int, float]] = []
        turns: dict[str, list[tuple[int, _Row]]] = {}  # distinct rows deciding items this step, per request
        for index, row in self.rows.items():
            if index < n:
                if row.distinct and row.broken is None and self._consume(row) and row.ahead is None:
                    assert row.cursor is not None
                    if not row.cursor.finished and not row.cursor.thinking:
                        turns.setdefault(cast(str, row.group), []).append((index, row))
                        continue
                if row.cursor is not None or row.broken is not None:
                    steps[index] = self._row_step(row)
                if row.scale is not None:
                    scaled.append((index, row.scale))
        for members in turns.values():
            drawn = _contending(members)
            for index, row in members:
                steps[index] = self._draw(row, logits[index]) if index in drawn else self._row_step(row)
                if row.scale is not None:
                    scaled.append((index, row.scale))
        try:
            apply_steps(logits, steps, self._mask_buffer)
        except Exception:  # never let vLLM's engine die of it: every constrained row gets its end token
            logger.exception("masking the batch failed; ending its constrained rows")
            for index, row in self.rows.items():
                if index < n and row.cursor is not None:
                    row.broken = Step(ALLOW, None, row.cursor.end_token_id)
                    steps[index] = row.broken
            apply_steps(logits, steps)
        mask_padded_vocab(logits, self.vocab_size)
        for index, scale in scaled:  # temperatures above vLLM's 2: logits * (2 / T), then vLLM divides by 2
            logits[index] *= scale
        self.stats["steps"] += 1
        self.stats["chain_seconds"] += time.perf_counter() - t0
        return logits

    def _apply_lane(self, logits: torch.Tensor, t0: float) -> torch.Tensor:
        """:meth:`apply` with the vector lane: rows of the lane that got one new token advance together, the batch
        is masked by :func:`processors.lanes.mask_rows` (lane rows as arrays, the others by their step)."""
        n = logits.shape[0]
        self._settle_masks(n, lanes=True)
        batch: list = [_FREE_ROW] * n
        scaled: list[tuple[int, float]] = []
        moved: list[_Row] = []
        moved_at: list[int] = []
        tokens: list[int] = []
        for index, row in self.rows.items():
            if index >= n:
                continue
            if row.scale is not None:
                scaled.append((index, row.scale))
            cursor = row.cursor
            if row.broken is None and cursor is not None and lane_of(cursor):
                out = row.output_ids
                if len(out) == row.consumed + 1:  # the common case: one new token
                    token = out[row.consumed]
                    row.consumed += 1
                    if token >= 0:
                        moved.append(row)
                        moved_at.append(index)
                        tokens.append(token)
                    batch[index] = cursor
                    continue
                if len(out) == row.consumed:
                    batch[index] = cursor
                    continue
            if row.cursor is not None or row.broken is not None:
                batch[index] = _StepRow(self._row_step(row))
        try:
            if moved:
                for k in advance_rows([r.cursor for r in moved], tokens):
                    self._break(moved[k])
                    batch[moved_at[k]] = _StepRow(cast(Step, moved[k].broken))
            for index in mask_rows(logits, batch, self._mask_buffer):
                row = self.rows[index]
                self._break(row)
                apply_steps(logits, [row.broken if i == index else _FREE for i in range(n)])
        except Exception:  # never let vLLM's engine die of it: every constrained row gets its end token
            logger.exception("masking the batch failed; ending its constrained rows")
            steps = [_FREE] * n
            for index, row in self.rows.items():
                if index < n and (row.cursor is not None or row.broken is not None):
                    if row.broken is None:
                        self._break(row)
                    steps[index] = row.broken
            apply_steps(logits, steps)
        mask_padded_vocab(logits, self.vocab_size)
        for index, scale in scaled:
            logits[index] *= scale
        self.stats["steps"] += 1
        self.stats["chain_seconds"] += time.perf_counter() - t0
        return logits

    def _settle_masks(self, n: int, lanes: bool = False) -> None:
        """Advance the rows of the batch by their new tokens and compute their due grammar masks within the budget
        (``lanes``: the vector lane's rows are advanced by :meth:`_apply_lane` itself, and have no grammar masks).
        A late row's cursor is expired: its ``step()`` allows only its end token."""
        if not self.budget.enabled:
            return
        cursors = []
        for index, row in self.rows.items():
            cursor = row.cursor
            if index < n and cursor is not None and row.broken is None and not (lanes and lane_of(cursor)):
                if self._consume(row) and row.ahead is None:
                    cursors.append(cursor)
        if cursors:
            late, _ = self.budget.settle(cursors)
            if late:
                self.stats["late_rows"] += len(late)
                logger.warning("%d row(s) ended: grammar mask over %g ms (%s)", len(late), self.budget.budget_ms,
                               SETTING)

    def _break(self, row: _Row) -> None:
        """The row's cursor raised: from now on it may emit only its end token."""
        if row.broken is None:
            logger.error("a row's constraint failed; forcing its end token")
            self.stats["failed_rows"] += 1
            assert row.cursor is not None
            row.broken = Step(ALLOW, None, row.cursor.end_token_id)

    # -- item controls ----------------------------------------------------------------------------
    def _draw(self, row: _Row, logits_row: torch.Tensor) -> Step:
        """A distinct row's turn: its token drawn here from its masked distribution and advanced at once (the next
        row of its request sees the item it takes); vLLM gets that token alone."""
        cursor = row.cursor
        assert cursor is not None
        try:
            sub = logits_row[None].clone()
            apply_steps(sub, [cursor.step()])
            mask_padded_vocab(sub, self.vocab_size)
            token = draw(sub[0], row.sampling, row.generator)
            cursor.advance(token)
        except Exception:
            logger.exception("drawing a distinct row's token failed; forcing its end token")
            self._break(row)
            return cast(Step, row.broken)
        row.ahead = token
        self.stats["drawn"] += 1
        return Step(ALLOW, as_ids([token]), token)

    def _leave(self, row: _Row | None) -> None:
        """A row with item controls leaves the batch: its last tokens first (an end token claims its item)."""
        if row is None or row.group is None:
            return
        group, row.group = row.group, None
        if row.broken is None:
            self._consume(row)
        cursor = row.cursor
        finished = (row.broken is not None or cursor is None or cursor.finished
                    or (row.max_tokens is not None and len(row.output_ids) >= row.max_tokens))
        self.groups.leave(group, finished, cursor)

    # -- rows -------------------------------------------------------------------------------------
    def _safe_new_row(self, params: "SamplingParams", prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        """:meth:`_new_row`, or a row held to the EOS token when it cannot be built (an exception here would
        end vLLM's whole engine): the replica's replay then reports the row as an ``error`` output."""
        try:
            return self._new_row(params, prompt_ids, output_ids)
        except Exception:
            logger.exception("building a row's cursor failed; ending the row")
            self.stats["failed_rows"] += 1
            row = _Row(None, output_ids)
            eos = self._tokenizer.eos_token_id if self._tokenizer is not None else (params.stop_token_ids or [0])[-1]
            row.broken = Step(ALLOW, None, int(eos))
            return row

    def _new_row(self, params: "SamplingParams", prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        extra = (params.extra_args or {}).get(EXTRA_KEY)
        if extra is None:
            return None
        cursor = None
        group = items = None
        if "key" in extra:
            compiled = self._scenario(extra["key"], extra["path"])
            tokenizer = self._load_tokenizer() if _needs_tokenizer(compiled) else None
            if extra.get("items") is not None:  # exclude / distinct / filter: the book its request's rows share
                group, items = self.groups.join(extra["items"], compiled)
            try:
                # a request that comes back after a preemption brings the tokens it already has: _row_step
                # replays them; the token budget and multi-item rules bind every tree and label row
                cursor = RowCursor(compiled, tokenizer, max_new_tokens=params.max_tokens, items=items)
            except BaseException:
                if group is not None:
                    self.groups.leave(group, True)
                raise
        self.stats["rows"] += 1
        row = _Row(cursor, output_ids, extra.get("scale"))
        if group is not None:
            row.group, row.max_tokens = group, params.max_tokens
            row.distinct = bool(items is not None and items.distinct)
            if row.distinct:
                row.sampling, row.generator = row_sampling(params, row.scale), row_generator(params)
        return row

    def _consume(self, row: _Row) -> bool:
        """Advance the row's cursor by its new output tokens; ``False`` when it raised (the row is broken)."""
        cursor = row.cursor
        assert cursor is not None
        try:
            out = row.output_ids
            while row.consumed < len(out):
                token = out[row.consumed]
                row.consumed += 1
                if token < 0:  # placeholders of tokens not yet known (async scheduling) are never consumed
                    continue
                if row.ahead is not None:  # drawn here and advanced already
                    ahead, row.ahead = row.ahead, None
                    if token == ahead:
                        continue
                    raise RuntimeError(f"vLLM sampled {token}, not the token {ahead} drawn for this distinct row")
                cursor.advance(token)
            return True
        except Exception:
            logger.exception("a row's constraint failed; forcing its end token")
            self.stats["failed_rows"] += 1
            row.broken = Step(ALLOW, None, cursor.end_token_id)  # an empty ALLOW keeps only the fallback: the end token
            return False

    def _row_step(self, row: _Row) -> Step:
        if row.broken is not None or not self._consume(row):
            return cast(Step, row.broken)
        cursor = row.cursor
        assert cursor is not None
        if row.ahead is not None:  # drawn, not yet in output_ids (vLLM dropped that sample): the same token again
            return Step(ALLOW, as_ids([row.ahead]), row.ahead)
        try:
            return cursor.step()
        except Exception:
            logger.exception("a row's constraint failed; forcing its end token")
            self.stats["failed_rows"] += 1
            row.broken = Step(ALLOW, None, cursor.end_token_id)
            return row.broken

    # -- scenarios and the tokenizer ---------------------------------------------------------------
    def _scenario(self, key: str, path: str):
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = load_compiled(path, key)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            self.stats["loads"] += 1
        return compiled

    def _load_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from processors import get_lltokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path, local_files_only=True)
            get_lltokenizer(tokenizer)  # built once, cached per tokenizer object
            self.vocab_size = len(tokenizer)
            self._tokenizer = tokenizer
        return self._tokenizer


def _budget_ms() -> float:
    """``mask_step_budget_ms`` as the replica passed it (:data:`.handoff.BUDGET_ENV`); 200 ms when unset or bad."""
    try:
        value = float(os.environ.get(BUDGET_ENV, "200"))
    except ValueError:
        value = 200.0
    return value if value >= 0 and math.isfinite(value) else 200.0


_watching = False


def watch_owner(interval: float = 1.0) -> None:
    """End vLLM's engine process and this worker when the replica that started them is gone.

    vLLM's engine core does not notice a client that died without shutting it down (a replica killed with
    SIGKILL): it and its worker would stay behind, holding the model and the KV cache. The replica names
    itself in :data:`OWNER_ENV` (``pid:start time``); this thread, in the worker, checks it every ``interval``
    seconds and then kills the engine core (this worker's parent) and exits.
    """
    global _watching
    spec = os.environ.get(OWNER_ENV)
    if _watching or not spec:
        return
    _watching = True
    import psutil

    pid_text, _, started = spec.partition(":")
    owner, parent = int(pid_text), os.getppid()

    def gone() -> bool:
        try:
            proc = psutil.Process(owner)
            return proc.status() == psutil.STATUS_ZOMBIE or (started and f"{proc.create_time():.2f}" != started)
        except psutil.NoSuchProcess:
            return True

    def run() -> None:
        while not gone():
            time.sleep(interval)
        logger.warning("the replica process %d is gone: stopping vLLM's engine core (pid %d) and this worker", owner, parent)
        if parent not in (owner, 1):
            try:
                os.kill(parent, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)

    threading.Thread(target=run, name="owner-watch", daemon=True).start()


def _contending(members: list[tuple[int, "_Row"]]) -> set[int]:
    """The batch indexes of a distinct request's rows whose tokens must be drawn in turn this step: rows at the same
    item position (:meth:`processors.base.Cursor.item_position`: they choose among the same items), or every row
    when one of them has no position (a multi-item row may start its next item anywhere). Rows at different
    positions choose among disjoint items, so they are masked as usual (and report their distribution)."""
    if len(members) < 2:
        return set()
    states: dict[Any, list[int]] = {}
    for index, row in members:
        constraint = row.cursor.constraint if row.cursor is not None else None
        position = constraint.item_position() if constraint is not None else None  # Cursor.item_position
        if position is None:
            return {index for index, _ in members}
        states.setdefault(position, []).append(index)
    return {index for group in states.values() if len(group) > 1 for index in group}


def _needs_tokenizer(compiled) -> bool:
    return compiled is not None and compiled.capabilities.grammar

"""Item controls in vLLM's worker: one :class:`processors.items.ItemRequest` per request of ours, shared by its rows.

A request of ``n`` rows is ``n`` vLLM requests; each row's ``extra_args[EXTRA_KEY]["items"]`` (from
:func:`.params.item_extra`) names the group (our request's id), its row count, ``distinct`` and the book of
excluded items. :class:`ItemGroups` builds the :class:`ItemRequest` when the group's first row joins vLLM's batch
and hands the same object to every later row, so the rows' cursors (:class:`processors.RowCursor` bound to it, as
in the transformers backend) see each other's occupied and finished items.

Release: a group is dropped when all its rows have left the batch finished; a row that leaves unfinished (vLLM
preempted it, or the request was aborted: a cancelled or closed stream) gives back the item it occupied, and a
group none of whose rows is in the batch is dropped after :data:`IDLE_SECONDS` (a preempted row comes back well
within that; an aborted one never does) or when more than :data:`MAX_IDLE` groups wait so.

``distinct`` and one step: vLLM samples every row of its batch at once from the logits the processor returns,
whereas the rule needs the rows of a request to choose in turn (two rows must never both take the last free item
below a state, and two rows at one state must never both end the same item). So when two or more rows of a
``distinct`` group are at the same state of the tree in the same step (any rows of a multi-item group: a row that
ends an item may go on at the root), the processor draws their tokens itself, one row after the other, each from its own masked distribution with its own temperature, top-k, top-p and seed, advances
that row's cursor at once (the next row's mask sees it), and hands vLLM that token alone (:func:`draw`). This is
the transformers backend's rule (it redraws a row whose token lost its item to an earlier row of the step; drawing
from the updated mask is the same distribution). Such tokens report log probability 0 in ``logprobs`` (vLLM sees
one allowed token). Rows at different states choose among disjoint children and item ends (the tables are a
tree), so they are masked as usual.

Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from types import SimpleNamespace

import torch

from processors.items import ItemRequest

from ..sampling import sample_row

from .params import item_request_of

__all__ = ["IDLE_SECONDS", "MAX_IDLE", "ItemGroups", "draw", "row_generator", "row_sampling"]

#: a group none of whose rows is in vLLM's batch is dropped after this long (aborted requests' groups)
IDLE_SECONDS = 120.0
#: most such idle groups kept
MAX_IDLE = 1024


class _Group:
    __slots__ = ("request", "rows", "finished", "live", "idle_since")

    def __init__(self, request: ItemRequest, rows: int):
        self.request = request
        self.rows = rows
        self.finished = 0
        self.live = 0
        self.idle_since: float | None = None


class ItemGroups:
    """The item controls of the requests whose rows are in (or due back in) vLLM's batch, by our request id."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self._idle: OrderedDict[str, float] = OrderedDict()
        self.stats = {"groups": 0, "released": 0, "expired": 0, "drawn": 0}

    def __len__(self) -> int:
        return len(self.groups)

    def join(self, extra: dict, compiled=None) -> tuple[str, ItemRequest]:
        """A row of the group ``extra["group"]`` enters the batch: the group's shared :class:`ItemRequest`
        (``compiled``: the version its rows decode, which resolves a filter)."""
        self.expire()
        key = str(extra["group"])
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(item_request_of(extra, compiled), max(int(extra.get("rows", 1)), 1))
            self.stats["groups"] += 1
        group.live += 1
        group.idle_since = None
        self._idle.pop(key, None)
        return key, group.request

    def leave(self, key: str, finished: bool, cursor=None) -> None:
        """A row leaves the batch: ``finished`` (its last token consumed by ``cursor``), or not (preempted or
        aborted: a ``distinct`` row gives back the item it occupied)."""
        group = self.groups.get(key)
        if group is None:
            return
        group.live -= 1
        if finished:
            group.finished += 1
        else:
            release_occupied(cursor)
        if group.finished >= group.rows:
            del self.groups[key]
            self._idle.pop(key, None)
            self.stats["released"] += 1
        elif group.live <= 0:
            group.idle_since = time.monotonic()
            self._idle[key] = group.idle_since
        self.expire()

    def expire(self, now: float | None = None) -> None:
        """Drop groups with no row in the batch for :data:`IDLE_SECONDS`, and the oldest past :data:`MAX_IDLE`."""
        if not self._idle:
            return
        now = time.monotonic() if now is None else now
        while self._idle:
            key, since = next(iter(self._idle.items()))
            if now - since < IDLE_SECONDS and len(self._idle) <= MAX_IDLE:
                break
            self._idle.popitem(last=False)
            self.groups.pop(key, None)
            self.stats["expired"] += 1


def release_occupied(cursor) -> None:
    """Give back the item a ``distinct`` row occupies (the states of its unfinished item); its finished items stay
    taken (:meth:`processors.base.Cursor.release_item`). ``cursor``: the row's :class:`processors.RowCursor`."""
    constraint = cursor.constraint if cursor is not None else None
    if constraint is not None:
        constraint.release_item()


def row_sampling(params, scale: float | None) -> SimpleNamespace:
    """A row's own sampling settings (vLLM's ``SamplingParams``; ``scale``: the processor's temperature scale)."""
    temperature = float(params.temperature or 0.0)
    if scale:
        temperature /= scale
    return SimpleNamespace(temperature=temperature, top_k=max(int(params.top_k or 0), 0),
                           top_p=float(params.top_p if params.top_p is not None else 1.0))


def row_generator(params) -> torch.Generator:
    """The row's generator for :func:`draw`: seeded rows reproduce (``seed`` is already ``seed + row``)."""
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device="cpu").manual_seed(int(seed))


def draw(logits: torch.Tensor, sampling: SimpleNamespace, generator: torch.Generator) -> int:
    """One token from one row of (already masked) logits, with the row's temperature, top-k and top-p (the
    transformers engine's own row sampler, :func:`deployments.engines.sampling.sample_row`)."""
    return sample_row(logits.float().cpu(), sampling, generator)

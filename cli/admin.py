"""``cs-admin``: the service's admin HTTP API (and a quick generate) from a shell.

Commands map one to one onto routes (see the README's "Using the service"):

=================================  ============================================================
``list``                           ``GET /v1/scenarios`` (public: no token needed)
``get NAME [--version N]``         ``GET /admin/scenarios/NAME[?version=N]``
``put NAME FILE|-``                ``PUT /admin/scenarios/NAME`` with the file streamed as the body
``put NAME --items CATALOG``       the same with a catalog (``application/x-ndjson``, or a Parquet file)
``patch NAME --add F --remove F``  ``PATCH /admin/scenarios/NAME`` ``{"add": [...], "remove": [...]}``
``delete NAME``                    ``DELETE /admin/scenarios/NAME``
``versions NAME``                  ``GET /admin/scenarios/NAME/versions``
``rollback NAME VERSION``          ``POST /admin/scenarios/NAME/rollback``
``try NAME PROMPT``                ``POST /v1/generate`` (public), optionally streamed (SSE)
=================================  ============================================================

The writes (``put``, ``patch``, ``delete``, ``rollback``) send an ``Idempotency-Key`` header, one new key per
command, and retry an HTTP 503 ("retry later") up to ``--retries`` times with the same key: a write
that was stored although the answer was a 503 is not made twice; the retry gets the first answer.

The HTTP client is in ``cli/admin_client.py``. Only ``httpx`` and ``tqdm`` are imported (no server code), so the
tool starts fast and runs anywhere. Every failure is one line on stderr and an exit code from :data:`EXIT_CODES`; the admin token is never
printed (messages pass through :func:`_redact` on the way out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from cli.admin_client import (  # noqa: F401  (EXIT_CODES and CliError are this module's API too)
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    MAX_KNOWN_SHOWN,
    PROGRESS_MIN_BYTES,
    STATUS_EXIT,
    UPLOAD_CHUNK_BYTES,
    AdminClient,
    CliError,
    read_body,
    scenario_path,
)

__all__ = ["EXIT_CODES", "CliError", "main"]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _when(value: Any) -> str:
    """A stored ``created_at`` (seconds since the epoch, maybe as a string) as local time."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(value)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "" if value is None else str(value)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


# --------------------------------------------------------------------------------------------- commands


def cmd_list(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.request("GET", "/v1/scenarios", admin=False)
    if args.json:
        _print_json(answer)
        return EXIT_OK
    rows = [[s.get("name"), s.get("type"), s.get("version")] for s in answer.get("scenarios", [])]
    print(_table(["NAME", "TYPE", "VERSION"], rows) if rows else "no scenarios")
    return EXIT_OK


def cmd_get(client: AdminClient, args: argparse.Namespace) -> int:
    params = {"version": args.version} if args.version is not None else None
    record = client.request("GET", scenario_path(args.name), params=params)
    if args.json:
        _print_json(record)
        return EXIT_OK
    version = str(record.get("version"))
    if record.get("from_version") is not None:
        version += f" (body of version {record['from_version']})"
    for field, value in (("name", record.get("name")), ("version", version), ("action", record.get("action")),
                         ("created", _when(record.get("created_at")))):
        print(f"{field + ':':<9}{value}")
    scenario = record.get("scenario")
    print("scenario: (none: this version is a delete entry)" if scenario is None else "scenario:")
    if scenario is not None:
        _print_json(scenario)
    return EXIT_OK


# ``put --tree``: a bare tree file (what ``cs-tree build`` writes) sent as the body of a tree scenario,
# wrapped on the fly so that a large file is still streamed, never loaded.
TREE_BODY_HEAD, TREE_BODY_TAIL = b'{"type": "tree", "tree": ', b"}"
CATALOG_CONTENT_TYPE = "application/x-ndjson"  # ``put --items``: the body is a catalog
PARQUET_CONTENT_TYPE = "application/vnd.apache.parquet"  # ``put --items``: a file that starts with Parquet's magic


def _chunks(content: Any, size: int, progress: Any, wrap: tuple[bytes, bytes] = (b"", b"")) -> Iterator[bytes]:
    """``content`` (bytes or an open file) in upload-sized chunks, advancing ``progress`` as they go out;
    ``wrap`` is sent before and after it (not counted in the progress)."""
    if wrap[0]:
        yield wrap[0]
    if isinstance(content, bytes):
        pieces = (content[i:i + UPLOAD_CHUNK_BYTES] for i in range(0, size, UPLOAD_CHUNK_BYTES))
    else:
        pieces = iter(lambda: content.read(UPLOAD_CHUNK_BYTES), b"")
    for piece in pieces:
        yield piece
        if progress is not None:
            progress.update(len(piece))
    if wrap[1]:
        yield wrap[1]
    if progress is not None:
        progress.close()


def cmd_put(client: AdminClient, args: argparse.Namespace) -> int:
    if (args.file is None) == (args.items is None):
        raise CliError("put: give a scenario FILE or --items CATALOG, not both or neither", EXIT_USAGE)
    if args.items is not None and args.tree:
        raise CliError("put: --tree and --items are different formats; give one", EXIT_USAGE)
    source = args.items if args.items is not None else args.file
    content_type = CATALOG_CONTENT_TYPE if args.items is not None else "application/json"
    content, size, handle = read_body(source)
    if args.items is not None and (content[:4] if handle is None else handle.read(4)) == b"PAR1":  # Parquet's magic
        content_type = PARQUET_CONTENT_TYPE
    if handle is not None:
        handle.seek(0)
    try:
        if size == 0:
            expected = "a catalog (header line, then one JSON array per line)" if args.items else "a scenario JSON object"
            raise CliError(f"{'stdin' if source == '-' else source} is empty: expected {expected}", EXIT_USAGE)
        show = args.progress if args.progress is not None else size >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
        # A sized stream: Content-Length lets the service refuse an oversized body (413) before reading it.
        wrap = (TREE_BODY_HEAD, TREE_BODY_TAIL) if args.tree else (b"", b"")

        def body(attempt: int) -> Iterator[bytes]:
            """The body streamed again from the start for each attempt (a retry after a 503)."""
            progress = None
            if attempt and handle is not None:
                handle.seek(0)
            elif not attempt and show:
                from tqdm import tqdm

                progress = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                                desc=f"upload {args.name}", dynamic_ncols=True)
            return _chunks(content, size, progress, wrap)

        answer = client.request("PUT", scenario_path(args.name), idempotent=True, content_factory=body,
                                headers={"Content-Type": content_type,
                                         "Content-Length": str(size + len(wrap[0]) + len(wrap[1]))})
    finally:
        if handle is not None:
            handle.close()
    if args.json:
        _print_json(answer)
    else:
        items = f" ({answer['items']} items)" if "items" in answer else ""
        print(f"stored {answer.get('name')} version {answer.get('version')}{items} (every replica serves it)")
    return EXIT_OK


def _delta_values(source: str, text: bool) -> list[Any]:
    """The items of a ``patch --add/--remove`` file: one per non-empty line, a JSON value (``[12, 40, 7]`` for a
    tree item, ``"label"`` for a label); a line that is not JSON is a label as written. ``text``: every line is a
    label as written."""
    try:
        if source == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(source, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {source}: {getattr(exc, 'strerror', None) or exc}", EXIT_USAGE) from None
    values: list[Any] = []
    for line in lines:
        if not line.strip():
            continue
        if text:
            values.append(line)
            continue
        try:
            values.append(json.loads(line))
        except ValueError:
            values.append(line.strip())
    return values


def cmd_patch(client: AdminClient, args: argparse.Namespace) -> int:
    if args.add is None and args.remove is None:
        raise CliError("patch: give --add FILE and/or --remove FILE", EXIT_USAGE)
    if args.add == "-" and args.remove == "-":
        raise CliError("patch: only one of --add and --remove can read stdin", EXIT_USAGE)
    body: dict[str, Any] = {}
    if args.add is not None:
        body["add"] = _delta_values(args.add, args.text)
    if args.remove is not None:
        body["remove"] = _delta_values(args.remove, args.text)
    headers = {} if args.base_version is None else {"If-Match": f'"{args.base_version}"'}
    answer = client.request("PATCH", scenario_path(args.name), idempotent=True, json=body, headers=headers)
    if args.json:
        _print_json(answer)
        return EXIT_OK
    present, absent = answer.get("already_present") or [], answer.get("not_present") or []
    if answer.get("changed") is False:
        print(f"{answer.get('name')} unchanged: version {answer.get('version')} already has every add and none of "
              "the removes (no new version)")
    else:
        print(f"patched {answer.get('name')}: version {answer.get('version')} (from {answer.get('base_version')}): "
              f"{answer.get('added', 0)} added, {answer.get('removed', 0)} removed (every replica serves it)")
    for what, values in (("already present (not added again)", present), ("not present (nothing removed)", absent)):
        if values:
            shown = ", ".join(json.dumps(v) for v in values[:MAX_KNOWN_SHOWN])
            more = f" and {len(values) - MAX_KNOWN_SHOWN} more" if len(values) > MAX_KNOWN_SHOWN else ""
            print(f"  {len(values)} {what}: {shown}{more}")
    return EXIT_OK


def cmd_delete(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.request("DELETE", scenario_path(args.name), idempotent=True)
    if args.json:
        _print_json(answer)
    else:
        print(f"deleted {answer.get('name')} (delete entry is version {answer.get('version')}; history kept)")
    return EXIT_OK


def cmd_versions(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.request("GET", scenario_path(args.name, "/versions"))
    if args.json:
        _print_json(answer)
        return EXIT_OK
    history = answer.get("versions", [])
    # Every write (put, rollback, delete) appends a version, so the newest one is current unless it is a delete.
    current = history[-1].get("version") if history and history[-1].get("action") != "delete" else None
    rows = [["*" if h.get("version") == current else "", h.get("version"),
             f"{h.get('action')} (body pruned)" if h.get("pruned") else h.get("action"), h.get("type"),
             h.get("from_version"), _when(h.get("created_at"))] for h in history]
    print(_table(["", "VERSION", "ACTION", "TYPE", "FROM", "CREATED"], rows))
    return EXIT_OK


def cmd_rollback(client: AdminClient, args: argparse.Namespace) -> int:
    answer = client.request("POST", scenario_path(args.name, "/rollback"), idempotent=True,
                            json={"version": args.version})
    if args.json:
        _print_json(answer)
    else:
        print(f"rolled back {answer.get('name')}: version {answer.get('version')} has the body of version "
              f"{answer.get('from_version')} (every replica serves it)")
    return EXIT_OK


def _generate_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"scenario": args.name}
    if args.messages:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    for field in ("max_new_tokens", "temperature", "seed"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    return body


def _summary(response: dict[str, Any]) -> str:
    usage = response.get("usage") or {}
    reasons = ", ".join(str(o.get("finish_reason")) for o in response.get("outputs", []))
    return (f"[{response.get('scenario')} v{response.get('version')}: {reasons}; "
            f"{usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} new tokens]")


def _failed_outputs(response: dict[str, Any]) -> int:
    failed = [o for o in response.get("outputs", []) if o.get("finish_reason") == "error"]
    for output in failed:
        print(f"cs-admin: generation failed: {output.get('error') or 'no reason given'}", file=sys.stderr)
    return EXIT_ERROR if failed else EXIT_OK


def cmd_try(client: AdminClient, args: argparse.Namespace) -> int:
    body = _generate_body(args)
    if not args.stream:
        response = client.request("POST", "/v1/generate", admin=False, json=body)
        if args.json:
            _print_json(response)
        else:
            for output in response.get("outputs", []):
                print(output.get("text", ""))
            print(_summary(response), file=sys.stderr)
        return _failed_outputs(response)

    body["stream"] = True
    final: dict[str, Any] | None = None
    printed = False
    for event in client.events("/v1/generate", body):
        if args.json:
            print(json.dumps(event, ensure_ascii=False), flush=True)
        kind = event.get("type")
        if kind == "token" and not args.json:
            sys.stdout.write(event.get("text") or "")
            sys.stdout.flush()
            printed = True
        elif kind == "done":
            final = event.get("response")
        elif kind == "error" or (kind is None and "error" in event):
            error = event.get("error")
            status = event.get("status") or (error.get("status") if isinstance(error, dict) else None)
            message = error.get("message") if isinstance(error, dict) else error
            if printed:
                print()
            raise CliError(f"generation failed mid-stream: {message or 'no reason given'}"
                           + (f" (HTTP {status})" if status else ""), STATUS_EXIT.get(status, EXIT_ERROR))
    if not args.json:
        print()
        if final:
            print(_summary(final), file=sys.stderr)
    return _failed_outputs(final or {})


COMMANDS = {"list": cmd_list, "get": cmd_get, "put": cmd_put, "patch": cmd_patch, "delete": cmd_delete,
            "versions": cmd_versions, "rollback": cmd_rollback, "try": cmd_try}


# --------------------------------------------------------------------------------------------- arguments


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _add_common(parser: argparse.ArgumentParser, *, on_command: bool) -> None:
    """Connection and output options, accepted before or after the command. On the command's parser
    they default to SUPPRESS, so an option given before the command is not reset by the command."""
    d = (lambda value: argparse.SUPPRESS) if on_command else (lambda value: value)
    group = parser.add_argument_group("connection and output")
    group.add_argument("--url", default=d(None), help=f"service URL (default: $CS_URL or {DEFAULT_URL})")
    group.add_argument("--token", default=d(None), help="admin token (default: $ADMIN_TOKEN); never printed")
    group.add_argument("--token-file", default=d(None), metavar="PATH",
                       help="read the admin token from this file (e.g. the service's data/admin_token)")
    group.add_argument("--timeout", type=_positive_float, default=d(None), metavar="S",
                       help=f"seconds to wait for an answer (default: $CS_TIMEOUT or {DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--connect-timeout", type=_positive_float, default=d(DEFAULT_CONNECT_TIMEOUT_S), metavar="S",
                       help=f"seconds to wait for a connection (default: {DEFAULT_CONNECT_TIMEOUT_S:g})")
    group.add_argument("--json", action="store_true", default=d(False), help="print the service's raw JSON")
    group.add_argument("--retries", type=int, default=d(DEFAULT_RETRIES), metavar="N",
                       help=f"retries of a write (put, delete, rollback) answered 503, with the same Idempotency-Key "
                            f"(default: {DEFAULT_RETRIES}; 0: none)")


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog="cs-admin",
        description="Manage the scenarios of a running constrained-serve service and try them out.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "environment:\n  CS_URL        service URL (default http://127.0.0.1:8000)\n"
            "  ADMIN_TOKEN   admin token (the same variable the service reads)\n"
            "  CS_TIMEOUT    seconds to wait for an answer\n\n"
            f"exit codes:\n{codes}\n\n"
            "examples:\n  cs-admin put colors colors.json\n  cs-admin versions colors\n"
            "  cs-admin rollback colors 1\n  cs-admin try colors 'The sky is' --stream"
        ),
    )
    _add_common(parser, on_command=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _add_common(sub, on_command=True)
        return sub

    command("list", "list the scenarios being served (name, type, current version)")
    get = command("get", "show a scenario's current (or a given) version")
    get.add_argument("name", metavar="NAME")
    get.add_argument("--version", type=int, metavar="N", help="a stored version (default: the current one)")
    put = command("put", "create or replace a scenario from a JSON file; returns once every replica serves it")
    put.add_argument("name", metavar="NAME")
    put.add_argument("file", metavar="FILE", nargs="?", help="scenario JSON file, or - for stdin")
    put.add_argument("--items", metavar="CATALOG",
                     help="instead of FILE: a catalog (a header line {\"start_token_id\": ..., \"end_token_id\": ...}, "
                          "then one JSON array of token ids per line; or a Parquet file), or - for stdin")
    put.add_argument("--tree", action="store_true",
                     help="FILE is a bare tree file (what cs-tree build writes): store it as a tree scenario")
    put.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help=f"upload progress bar on stderr (default: for files of {PROGRESS_MIN_BYTES >> 20} MiB "
                          "or more, when stderr is a terminal)")
    patch = command("patch", "add and remove tree items or labels as a new version (PATCH); no-ops are reported")
    patch.add_argument("name", metavar="NAME")
    patch.add_argument("--add", metavar="FILE", help="items to add, one per line: [12, 40, 7] for a tree, a label "
                                                     "(as JSON or as plain text) for labels; - for stdin")
    patch.add_argument("--remove", metavar="FILE", help="items to remove, same format")
    patch.add_argument("--text", action="store_true", help="every line of the files is a label as written")
    patch.add_argument("--base-version", type=int, metavar="N",
                       help="refuse (409, nothing stored) unless version N is current (sent as If-Match)")
    delete = command("delete", "delete a scenario (its history is kept)")
    delete.add_argument("name", metavar="NAME")
    versions = command("versions", "a scenario's history (* marks the current version)")
    versions.add_argument("name", metavar="NAME")
    rollback = command("rollback", "store a new version with the body of an earlier one")
    rollback.add_argument("name", metavar="NAME")
    rollback.add_argument("version", type=int, metavar="VERSION")
    try_ = command("try", "generate with a scenario (POST /v1/generate) and print the answer")
    try_.add_argument("name", metavar="NAME")
    try_.add_argument("prompt", metavar="PROMPT")
    try_.add_argument("--messages", action="store_true", help="send PROMPT as a user chat message (chat template)")
    try_.add_argument("--max-new-tokens", type=int, metavar="N")
    try_.add_argument("--temperature", type=float, metavar="T")
    try_.add_argument("--seed", type=int)
    try_.add_argument("--stream", action="store_true", help="print tokens as they arrive (server-sent events)")
    return parser


def _resolve_token(args: argparse.Namespace) -> str | None:
    if args.token:
        return args.token.strip()
    if args.token_file:
        try:
            return Path(args.token_file).expanduser().read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise CliError(f"cannot read --token-file {args.token_file}: {exc.strerror or exc}", EXIT_USAGE) from None
    return os.environ.get("ADMIN_TOKEN", "").strip() or None


def _resolve_timeout(args: argparse.Namespace) -> float:
    if args.timeout is not None:
        return args.timeout
    raw = os.environ.get("CS_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        return _positive_float(raw)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"CS_TIMEOUT: {exc}", EXIT_USAGE) from None


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "<token>") if token and len(token) >= 4 else text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = None
    try:
        token = _resolve_token(args)
        url = args.url or os.environ.get("CS_URL") or DEFAULT_URL
        client = AdminClient(url, token, _resolve_timeout(args), args.connect_timeout, args.retries)
        try:
            return COMMANDS[args.command](client, args)
        finally:
            client.close()
    except CliError as error:
        if args.json and error.body is not None:
            print(_redact(json.dumps(error.body, indent=2, ensure_ascii=False), token))
        # One line, even when the service's message lists several problems on lines of their own.
        line = "; ".join(part.strip() for part in error.message.splitlines() if part.strip())
        print(f"cs-admin: {_redact(line, token)}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        print("cs-admin: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cs-admin ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""``cs-tree build``: a tree file from a label list, a CSV column or a taxonomy, for one tokenizer.

Every answer is tokenized the way the service tokenizes labels (``processors.labels.tokenize_continuation``):
as a continuation ``" " + text`` without special tokens, and it must decode back to exactly that text. An
answer that does not round-trip, or whose ids contain the end token, is reported with the reason and left out
(``--strict`` refuses to write the file instead).

The tree has the layout of ``deployments.examples.build_phrase_tree``: the root is the start token, each answer
is a path of its token ids followed by the end token, and candidates keep the order of the input.

Taxonomies: a line ``Technology > AI > NLP`` is a path of levels split on ``--level-sep`` (default ``>``). Each
level is stripped and the levels are joined again with ``--join`` (default ``" > "``), so the answer the model
writes is the path text ``" Technology > AI > NLP"``, tokenized as one continuation like any label. Every level
prefix the line implies (``Technology``, ``Technology > AI``) is an answer too, so the model may stop at a
coarser level; ``--full-paths-only`` keeps only the paths written in the file.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.tree_common import UserError, describe_token, progress, resolve_token, vocab_size

__all__ = ["BuildReport", "InputItems", "build_tree_file", "check_sep", "read_input", "write_tree_atomic"]

FORMATS = ("labels", "csv", "taxonomy")


@dataclass
class InputItems:
    """What was read from the input: unique answers in input order, and what was skipped and why."""

    texts: list[tuple[str, str]] = field(default_factory=list)  # (answer text, where: "line 3")
    read: int = 0  # non-blank entries (lines, rows)
    blank: int = 0
    duplicates: list[dict[str, str]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)  # input that is no answer at all
    implied: int = 0  # taxonomy: answers that are only level prefixes of other lines

    def add(self, text: str, where: str, first_at: dict[str, str]) -> None:
        """Append an answer, or record it as a duplicate of an earlier one (the first is kept)."""
        if text in first_at:
            self.duplicates.append({"where": where, "text": text, "first": first_at[text]})
        else:
            first_at[text] = where
            self.texts.append((text, where))


@dataclass
class BuildReport:
    """The outcome of a build, printed as text or JSON."""

    source: str
    output: str | None = None
    written: bool = False
    read: int = 0
    blank: int = 0
    implied: int = 0
    added: int = 0
    keys: int = 0
    start: str = ""
    end: str = ""
    duplicates: list[dict[str, str]] = field(default_factory=list)
    unencodable: list[dict[str, str]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "output": self.output, "written": self.written, "read": self.read,
            "blank": self.blank, "implied": self.implied, "added": self.added, "keys": self.keys,
            "start_token": self.start, "end_token": self.end, "duplicates": self.duplicates,
            "unencodable": self.unencodable, "rejected": self.rejected,
        }

    def lines(self, limit: int = 20) -> list[str]:
        out = [f"read {self.read} entries from {self.source}" + (f" ({self.blank} blank skipped)" if self.blank else "")]
        if self.implied:
            out.append(f"taxonomy levels implied by longer paths: {self.implied}")
        out.append(f"start token {self.start}, end token {self.end}")
        out.append(f"added: {self.added} answers, {self.keys} keys")
        for title, items, fmt in (
            ("duplicates (kept the first)", self.duplicates, lambda d: f"{d['where']}: {d['text']!r} (first at {d['first']})"),
            ("could not encode", self.unencodable, lambda d: f"{d['where']}: {d['text']!r}: {d['reason']}"),
            ("rejected input", self.rejected, lambda d: f"{d['where']}: {d['reason']}"),
        ):
            out.append(f"{title}: {len(items)}")
            out += [f"  {fmt(item)}" for item in items[:limit]]
            if len(items) > limit:
                out.append(f"  ... and {len(items) - limit} more")
        out.append(f"wrote {self.output}" if self.written else "no file written")
        return out


# --------------------------------------------------------------------------------------------------- input


def read_input(path: str, fmt: str, *, column: str | None = None, header: bool = True, delimiter: str | None = None,
               level_sep: str = ">", join: str | None = None, full_paths_only: bool = False,
               encoding: str = "utf-8-sig") -> InputItems:
    """Read the answers of ``path`` in format ``fmt`` (see :data:`FORMATS`). Raises :class:`UserError`."""
    if not os.path.exists(path):
        raise UserError(f"input file {path!r} does not exist")
    if os.path.isdir(path):
        raise UserError(f"input {path!r} is a directory, not a file")
    try:
        # csv needs newline="" (quoted cells may hold line breaks); plain lines use universal newlines
        with open(path, encoding=encoding, newline="" if fmt == "csv" else None) as handle:
            if fmt == "csv":
                items = _read_csv(handle, path, column, header, delimiter or ("\t" if path.endswith(".tsv") else ","))
            else:
                items = _read_lines(handle, dedupe=fmt != "taxonomy")
                if fmt == "taxonomy":
                    items = _taxonomy(items, level_sep, join, full_paths_only)
    except UnicodeDecodeError as error:
        raise UserError(f"{path!r} is not {encoding} text ({error.reason}); pass --encoding") from None
    except OSError as error:
        raise UserError(f"cannot read {path!r}: {error.strerror or error}") from None
    if not items.texts and not items.rejected:
        what = "the file is empty" if os.path.getsize(path) == 0 else "no non-blank entries"
        raise UserError(f"no answers in {path!r}: {what}")
    return items


def _read_lines(handle, dedupe: bool = True) -> InputItems:
    items = InputItems()
    first_at: dict[str, str] = {}
    for number, line in enumerate(handle, 1):
        text = line.strip()  # a label is never padded
        if not text:
            items.blank += 1
            continue
        items.read += 1
        if dedupe:
            items.add(text, f"line {number}", first_at)
        else:
            items.texts.append((text, f"line {number}"))
    return items


def _read_csv(handle, path: str, column: str | None, header: bool, delimiter: str) -> InputItems:
    reader = csv.reader(handle, delimiter=delimiter)
    items = InputItems()
    first_at: dict[str, str] = {}
    try:
        first = next(reader, None)
        if first is None:
            raise UserError(f"no answers in {path!r}: the file is empty")
        index = _csv_column(first, path, column, header)
        name = repr(first[index]) if header else f"{index}"
        rows = reader if header else _chain_first(first, reader)
        for row in rows:
            where = f"line {reader.line_num}"
            if not any(cell.strip() for cell in row) or (index < len(row) and not row[index].strip()):
                items.blank += 1
                continue
            items.read += 1
            if index >= len(row):
                items.rejected.append({"where": where, "reason": f"no column {name} (the row has {len(row)} columns)"})
            else:
                items.add(row[index].strip(), where, first_at)
    except csv.Error as error:
        raise UserError(f"{path!r}, line {reader.line_num}: unreadable CSV: {error}") from None
    if not items.texts and items.rejected:
        raise UserError(f"column {name} of {path!r} is missing in every row ({len(items.rejected)} rows)")
    return items


def _chain_first(first: list[str], rest):
    yield first
    yield from rest


def _csv_column(first: list[str], path: str, column: str | None, header: bool) -> int:
    names = ", ".join(repr(n) for n in first) if header else f"{len(first)} columns"
    if column is None:
        if len(first) == 1:
            return 0
        raise UserError(f"{path!r} has several columns ({names}); choose one with --column NAME or --column INDEX")
    stripped = [name.strip() for name in first]
    if header and column.strip() in stripped:
        return stripped.index(column.strip())
    if column.isdigit():
        index = int(column)
        if index >= len(first):
            raise UserError(f"--column {index}: {path!r} has only {len(first)} columns (indexes start at 0)")
        return index
    if not header:
        raise UserError(f"--column {column!r} names a column, but --no-header says the CSV has no header row")
    raise UserError(f"--column {column!r}: no such column in the header of {path!r} (columns: {names})")


def _taxonomy(lines: InputItems, level_sep: str, join: str | None, full_paths_only: bool) -> InputItems:
    if not level_sep:
        raise UserError("--level-sep must not be empty")
    joiner = join if join is not None else f" {level_sep.strip() or level_sep} "
    items = InputItems(read=lines.read, blank=lines.blank)
    explicit: dict[str, str] = {}  # full path of a line -> where it was first written
    answers: dict[str, str] = {}  # every answer, implied or written -> where it first appears
    implied: set[str] = set()
    for text, where in lines.texts:
        levels = [level.strip() for level in text.split(level_sep)]
        if not all(levels):
            items.rejected.append({"where": where, "reason": f"empty level in {text!r}"})
            continue
        full = joiner.join(levels)
        if full in explicit:
            items.duplicates.append({"where": where, "text": full, "first": explicit[full]})
            continue
        explicit[full] = where
        if not full_paths_only:
            for depth in range(1, len(levels)):
                prefix = joiner.join(levels[:depth])
                if prefix not in answers:
                    answers[prefix] = where
                    implied.add(prefix)
        if full in answers:
            implied.discard(full)  # a level written on its own line is an answer in its own right
        else:
            answers[full] = where
    items.texts = list(answers.items())
    items.implied = len(implied)
    return items


# --------------------------------------------------------------------------------------------------- building


def _encode_all(tokenizer, items: InputItems, end: int, report: BuildReport, show_progress: bool) -> list[list[int]]:
    from processors.labels import tokenize_continuation

    encoded: list[list[int]] = []
    bar = progress(items.texts, total=len(items.texts), desc="tokenizing", enabled=show_progress, unit="label")
    for text, where in bar:
        try:
            ids = tokenize_continuation(tokenizer, " " + text, what="label")
        except ValueError as error:
            report.unencodable.append({"where": where, "text": text, "reason": str(error)})
            continue
        if end in ids:
            reason = f"its ids {ids} contain the end token {end}"
            report.unencodable.append({"where": where, "text": text, "reason": reason})
            continue
        encoded.append(ids)
    return encoded


def _trie(paths: list[list[int]], start: int, end: int, sep: str) -> dict[str, dict[int, None]]:
    # dict-as-ordered-set: candidates keep input order (like build_phrase_tree) with O(1) membership
    prefix_dict: dict[str, dict[int, None]] = {}
    for ids in paths:
        state = str(start)
        for token in ids:
            prefix_dict.setdefault(state, {})[token] = None
            state = f"{state}{sep}{token}"
        prefix_dict.setdefault(state, {})[end] = None
    return prefix_dict


def write_tree_atomic(path: str, prefix_dict: dict[str, Any], *, start: int, end: int, sep: str, vocab: int,
                      show_progress: bool = False) -> None:
    """Write a tree file key by key into a temporary file next to ``path``, check it loads, then rename it."""
    from processors.kinds.tree.treefile.load import load_tree

    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise UserError(f"output directory {str(directory)!r} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise UserError(f"cannot write in {str(directory)!r}: {error.strerror or error}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            head = {"start_token_id": start, "end_token_id": end, "sep": sep}
            out.write(json.dumps(head)[:-1] + ', "prefix_dict": {')
            bar = progress(prefix_dict.items(), total=len(prefix_dict), desc="writing", enabled=show_progress, unit="key")
            for i, (key, cands) in enumerate(bar):
                out.write(("\n" if i == 0 else ",\n") + json.dumps(key) + ": " + json.dumps(list(cands)))
            out.write("\n}}\n")
            out.flush()
            os.fsync(out.fileno())
        load_tree(tmp, vocab_size=vocab)  # the file the service will read must load: a failure here is a bug
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a tree file is not a secret
        os.replace(tmp, target)
    except BaseException as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(error, OSError):  # a full disk, a read-only target: the user's to fix, not a bug
            raise UserError(f"cannot write {path!r}: {error.strerror or error}") from None
        raise


def check_sep(sep: str) -> None:
    """Refuse a key separator a strict load would refuse (checked by loading an empty tree with it): the files
    this tool writes load under ``strict: true`` too."""
    from processors.kinds.tree.treefile.load import TreeFileError, load_tree

    try:
        load_tree({"start_token_id": 0, "end_token_id": 0, "sep": sep, "prefix_dict": {"0": []}}, strict=True)
    except TreeFileError as error:
        raise UserError(f"--sep: {error.problems[0].removeprefix('sep: ')}") from None


def build_tree_file(tokenizer, items: InputItems, *, source: str, output: str, start: str | None, end: str | None,
                    sep: str = "_", strict: bool = False, show_progress: bool = False) -> tuple[BuildReport, int]:
    """Encode ``items``, write the tree to ``output`` and return ``(report, exit_code)``.

    Exit code 1 (no file written) when nothing could be encoded, or with ``strict`` when anything was
    rejected or could not be encoded; else 0.
    """
    from deployments.examples import chat_root_token_id
    from processors.tokenizer_info import TokenizerInfo

    check_sep(sep)
    def chat_root() -> int:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        return chat_root_token_id(tokenizer)

    start_id = resolve_token(tokenizer, start, option="--start-token", default=chat_root)

    def eos() -> int:
        eos_ids = TokenizerInfo.of(tokenizer).eos_token_ids
        if not eos_ids:
            raise ValueError("the tokenizer has no eos_token_id")
        return eos_ids[0]

    end_id = resolve_token(tokenizer, end, option="--end-token", default=eos)
    report = BuildReport(source=source, output=output, read=items.read, blank=items.blank, implied=items.implied,
                         duplicates=list(items.duplicates), rejected=list(items.rejected),
                         start=describe_token(tokenizer, start_id), end=describe_token(tokenizer, end_id))
    paths = _encode_all(tokenizer, items, end_id, report, show_progress)
    report.added = len(paths)
    if not paths or (strict and (report.unencodable or report.rejected)):
        return report, 1
    prefix_dict = _trie(paths, start_id, end_id, sep)
    report.keys = len(prefix_dict)
    write_tree_atomic(output, prefix_dict, start=start_id, end=end_id, sep=sep, vocab=vocab_size(tokenizer),
                      show_progress=show_progress)
    report.written = True
    return report, 0

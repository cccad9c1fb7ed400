"""``cs-tree``: build tree files from labels, CSV columns or taxonomies, and lint existing tree files, offline.

Usage::

    cs-tree build labels.txt -o tree.json                      # default model's tokenizer, chat-root start, EOS end
    cs-tree build topics.csv --column topic -o tree.json --tokenizer path/to/model.gguf
    cs-tree build taxonomy.txt --format taxonomy -o tree.json  # "Technology > AI > NLP", one path a line
    cs-tree lint tree.json --sample 5 [--json]

Exit codes: 0 success (lint: no errors; warnings allowed), 1 nothing could be encoded / ``--strict`` found an
unencodable entry / lint found errors, 2 bad input (missing file, unknown column, unusable tokenizer path, ...),
printed as one line without a traceback. Reports go to stdout; progress bars go to stderr, only when stderr is a
terminal and ``--quiet`` is not given. See ``cli/tree_build.py`` and ``cli/tree_lint.py`` for the rules.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from cli.tree_common import UserError, load_cli_tokenizer, progress_enabled

__all__ = ["main", "make_parser"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cs-tree", description="Build and lint token tree files (the tree file format of constrained-serve).",
        epilog="Exit codes: 0 ok, 1 build failed or lint errors, 2 bad input.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build,lint}")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tokenizer", metavar="PATH",
                        help="a GGUF file, an HF model or tokenizer directory (default: the default model's tokenizer)")
    common.add_argument("--json", action="store_true", help="print the report as JSON")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    build = commands.add_parser(
        "build", parents=[common], help="build a tree file from labels, a CSV column or a taxonomy",
        description="Tokenize each entry as a continuation (' ' + text), check it decodes back, and write the "
        "tree of all entries. A taxonomy line 'A > B > C' becomes the answer ' A > B > C' (levels joined by "
        "--join), and its levels 'A' and 'A > B' become answers too unless --full-paths-only.",
    )
    build.add_argument("input", metavar="INPUT", help="label file (one a line), CSV file, or taxonomy file")
    build.add_argument("-o", "--output", required=True, metavar="TREE_FILE", help="the tree file to write (atomically)")
    build.add_argument("--format", choices=("labels", "csv", "taxonomy"),
                       help="input format (default: csv for .csv/.tsv files, else labels)")
    build.add_argument("--column", metavar="NAME|INDEX", help="CSV: the column, by header name or 0-based index")
    build.add_argument("--no-header", action="store_true", help="CSV: the first row is data, not a header")
    build.add_argument("--delimiter", metavar="CHAR", help="CSV: field delimiter (default: tab for .tsv, else ',')")
    build.add_argument("--level-sep", default=">", metavar="TEXT", help="taxonomy: splits the levels of a line (default '>')")
    build.add_argument("--join", metavar="TEXT",
                       help="taxonomy: joins the levels in the answer text (default: --level-sep with a space each side)")
    build.add_argument("--full-paths-only", action="store_true",
                       help="taxonomy: only the full path of each line is an answer, not the levels it implies")
    build.add_argument("--encoding", default="utf-8-sig", help="input text encoding (default utf-8, BOM allowed)")
    build.add_argument("--start-token", metavar="ID|TOKEN",
                       help="root token (default: the last token of the chat template's generation prompt)")
    build.add_argument("--end-token", metavar="ID|TOKEN", help="end token (default: the tokenizer's EOS)")
    build.add_argument("--sep", default="_", help="separator in prefix_dict keys (default '_')")
    build.add_argument("--strict", action="store_true", help="fail (exit 1, no file) if any entry cannot be encoded")

    lint = commands.add_parser(
        "lint", parents=[common], help="check a tree file against a tokenizer",
        description="Report format problems, ids outside the vocabulary, a missing root entry, unreachable keys and "
        "states that cannot reach the end token (errors), and suspicious but valid content (warnings); print a "
        "seeded sample of decoded paths. Exit code 1 when there are errors.",
    )
    lint.add_argument("tree_file", metavar="TREE_FILE")
    lint.add_argument("--sample", type=_non_negative, default=10, metavar="N", help="decoded paths to print (default 10)")
    lint.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    lint.add_argument("--strict", action="store_true",
                      help="load as a scenario with strict: true does (keys outside the root, unknown fields, a "
                           "'-' in sep, negative or beyond-int32 ids are errors instead of warnings)")
    lint.add_argument("--max-new-tokens", type=_positive, metavar="N",
                      help="warn about paths longer than this (default: the service's default max_new_tokens)")
    return parser


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _build(args: argparse.Namespace) -> int:
    from cli.tree_build import build_tree_file, check_sep, read_input

    fmt = args.format or ("csv" if args.input.lower().endswith((".csv", ".tsv")) else "labels")
    if fmt != "csv" and (args.column is not None or args.no_header or args.delimiter is not None):
        raise UserError("--column, --no-header and --delimiter apply to CSV input only (use --format csv)")
    if fmt != "taxonomy" and (args.join is not None or args.full_paths_only or args.level_sep != ">"):
        raise UserError("--level-sep, --join and --full-paths-only apply to taxonomy input only (use --format taxonomy)")
    check_sep(args.sep)
    if args.delimiter is not None and len(args.delimiter) != 1:
        raise UserError(f"--delimiter must be one character, got {args.delimiter!r}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise UserError(f"output directory {out_dir!r} does not exist")
    if os.path.isdir(args.output):
        raise UserError(f"output {args.output!r} is a directory; name the tree file to write")
    items = read_input(args.input, fmt, column=args.column, header=not args.no_header, delimiter=args.delimiter,
                       level_sep=args.level_sep, join=args.join, full_paths_only=args.full_paths_only,
                       encoding=args.encoding)
    tokenizer = load_cli_tokenizer(args.tokenizer)
    report, code = build_tree_file(tokenizer, items, source=args.input, output=args.output, start=args.start_token,
                                   end=args.end_token, sep=args.sep, strict=args.strict,
                                   show_progress=progress_enabled(args.quiet))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        print("\n".join(report.lines()))
    if code and not args.json:
        why = "nothing could be encoded" if not report.added else "--strict: some entries could not be used"
        print(f"cs-tree: build failed: {why}", file=sys.stderr)
    return code


def _lint(args: argparse.Namespace) -> int:
    from cli.tree_lint import lint_tree_file

    if not os.path.exists(args.tree_file):
        raise UserError(f"tree file {args.tree_file!r} does not exist")
    if os.path.isdir(args.tree_file):
        raise UserError(f"{args.tree_file!r} is a directory, not a tree file")
    tokenizer = load_cli_tokenizer(args.tokenizer)
    try:
        report = lint_tree_file(args.tree_file, tokenizer, sample=args.sample, seed=args.seed,
                                max_new_tokens=args.max_new_tokens, show_progress=progress_enabled(args.quiet),
                                strict=args.strict)
    except OSError as error:
        raise UserError(f"cannot read {args.tree_file!r}: {error.strerror or error}") from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cs-tree`` console script; returns the exit code."""
    args = make_parser().parse_args(argv)
    # The loader logs a missing root entry as a warning; lint reports it itself, as an error.
    logging.getLogger("processors.kinds.tree.treefile.load").setLevel(logging.ERROR)
    try:
        return _build(args) if args.command == "build" else _lint(args)
    except UserError as error:
        print(f"cs-tree: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("cs-tree: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `cs-tree lint ... | head`
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

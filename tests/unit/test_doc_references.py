"""Every repository path the README and docs/*.md name resolves, and every ``path.py:name`` names something defined in
that module (a function, a class or a module-level name), so that moving or renaming code cannot leave the docs
pointing at nothing. A path may be written from the repository root or from inside a package
(``replica/model_replica.py`` for ``deployments/replica/model_replica.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", ".venv", ".venv-vllm", "data", "node_modules", "__pycache__", ".pytest_cache", ".mypy_cache",
        ".ruff_cache"}
#: a path with a known suffix, optionally followed by ``:name`` (``deployments/guards.py:RowBudget``)
REFERENCE = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|sh|yaml|toml|js|json|html|css))"
                       r"(?::([A-Za-z_][\w.]*))?")


def _repository_files() -> list[str]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.endswith(".egg-info")]
        rel = Path(folder).relative_to(ROOT)
        out += [(rel / f).as_posix() for f in files]
    return out


def _defines(source: str, name: str) -> bool:
    first = re.escape(name.split(".")[0])
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{first}\b|^\s*{first}\s*(?::[^=\n]*)?=", source, re.M) is not None


def _references(doc: Path):
    text = doc.read_text(encoding="utf-8")
    for match in REFERENCE.finditer(text):
        path, name = match.group(1), match.group(2)
        if "/" in path or name:  # a bare file name ("README.md") is prose, not a reference to check
            yield path, name, text.count("\n", 0, match.start()) + 1


def test_every_path_and_name_in_the_docs_resolves():
    files = _repository_files()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = []
    for doc in docs:
        for path, name, line in _references(doc):
            hits = [f for f in files if f == path or f.endswith("/" + path)]
            where = f"{doc.relative_to(ROOT)}:{line}: {path}{':' + name if name else ''}"
            if not hits:
                problems.append(f"{where}: no such file")
            elif name and path.endswith(".py") and not any(_defines((ROOT / h).read_text(encoding="utf-8"), name)
                                                           for h in hits):
                problems.append(f"{where}: {name.split('.')[0]} is not defined there")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_what_it_is_for(tmp_path):
    """The check itself: a moved file and a renamed function are found (the assertion above cannot pass vacuously)."""
    doc = tmp_path / "x.md"
    doc.write_text("see `deployments/guards.py:RowBudget` and `deployments/gone.py` and `guards.py:nothing_here`\n")
    found = list(_references(doc))
    assert [(p, n) for p, n, _ in found] == [("deployments/guards.py", "RowBudget"), ("deployments/gone.py", None),
                                             ("guards.py", "nothing_here")]
    source = (ROOT / "deployments/guards.py").read_text(encoding="utf-8")
    assert _defines(source, "RowBudget.acquire") and _defines(source, "GENERATE_PATHS")
    assert not _defines(source, "nothing_here")
    assert not any(f.endswith("/gone.py") for f in _repository_files())

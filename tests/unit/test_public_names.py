"""The public Python names: every name docs/api.md lists ("Public Python names") imports from the module it is
listed under, and every name that moved out of ``config`` still imports from its old place, with a
``DeprecationWarning`` naming the new module, as the same object."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from config.moved import MOVED

ROOT = Path(__file__).resolve().parents[2]


def _listed() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = text.split("<!-- public-names -->", 1)[1].split("<!-- /public-names -->", 1)[0]
    pairs = []
    for item in re.split(r"\n- ", "\n" + block.strip()):
        if not item.strip():
            continue
        module, _, names = item.partition(":")
        module = module.strip().strip("-").strip().strip("`")
        pairs.extend((module, name) for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", names))
    return pairs


LISTED = _listed()


def test_the_list_is_read():
    modules = {m for m, _ in LISTED}
    assert {"processors", "processors.scenarios", "config", "deployments.engines"} <= modules
    assert ("processors.kinds.tree.treefile.load", "load_tree") in LISTED and len(LISTED) > 60


@pytest.mark.parametrize("module,name", LISTED, ids=[f"{m}.{n}" for m, n in LISTED])
def test_a_listed_name_imports(module, name):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert getattr(importlib.import_module(module), name) is not None
    aliases = [str(w.message) for w in seen if "moved to" in str(w.message)]
    assert not aliases, f"a listed name is a deprecated alias: {aliases}"


MOVED_NAMES = [(old, name, new) for old, names in MOVED.items() for name, new in names.items()]


@pytest.mark.parametrize("old,name,new", MOVED_NAMES, ids=[f"{o}.{n}" for o, n, _ in MOVED_NAMES])
def test_a_moved_name_imports_from_its_old_place_with_a_warning(old, name, new):
    # in a fresh interpreter: the old module keeps a name once asked, so only the first import warns
    code = (f"import warnings; warnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    from {old} import {name} as value\n"
            f"import {new} as target\n"
            f"assert value is target.{name}, 'not the same object'\n"
            f"msgs = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
            f"assert len(msgs) == 1 and '{new}.{name}' in msgs[0], msgs\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_an_unknown_name_is_still_an_attribute_error():
    import config

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        config.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from config.tree_file import no_such_name")


def test_importing_config_loads_nothing_above_it():
    """The aliases resolve on first use only: ``config`` alone imports no module of ``processors`` or
    ``deployments``."""
    code = ("import sys, config, config.scenarios, config.tree_file\n"
            "above = sorted(m for m in sys.modules if m.split('.')[0] in ('processors', 'deployments'))\n"
            "assert not above, above\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

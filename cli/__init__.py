"""Operator command-line tools: ``cs-tree`` (build and lint tree files offline) and ``cs-admin`` (the admin
HTTP API from a shell). Console scripts declared in ``pyproject.toml``."""

#!/usr/bin/env bash
# Linters (run by .ci/run): ruff over the whole repository, mypy over the typed core (config/, processors/).
# Expects the virtualenv of scripts/setup.sh (the test extras bring ruff and mypy).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "lint: ruff"
.venv/bin/python -m ruff check .
echo "lint: mypy config processors"
.venv/bin/python -m mypy config processors
echo "lint: ok"

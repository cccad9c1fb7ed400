#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
echo "test: running pytest"
exec .venv/bin/python -m pytest tests -q -rs "$@"

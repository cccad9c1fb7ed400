#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the test suite, then the vLLM tier (scripts/test_vllm.sh).
# Extra arguments go to the main pytest run.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
echo "test: running pytest"
status=0
# tests/vllm needs vLLM, which lives in its own virtualenv (.venv-vllm): it runs below, not here.
.venv/bin/python -m pytest tests --ignore=tests/vllm -q -rs "$@" || status=$?
# The vLLM engine backend's tier.
# SKIP_VLLM=1 leaves it out.
if [ "${SKIP_VLLM:-}" != "1" ]; then
    bash scripts/test_vllm.sh || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
fi
exit "$status"

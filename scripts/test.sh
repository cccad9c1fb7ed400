#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the test suite, then the vLLM tier (scripts/test_vllm.sh).
# Extra arguments go to the main pytest run.
#
# The vLLM tier's virtualenv (scripts/setup_vllm.sh, several minutes of package installs) is built in the background
# while the main suite runs; its output is printed before the tier starts. SKIP_VLLM=1 leaves the tier out.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
vllm_setup_pid=""
vllm_setup_log=""
if [ "${SKIP_VLLM:-}" != "1" ]; then
    vllm_setup_log="$(mktemp -t setup_vllm.XXXXXX.log)"
    echo "test: building the vLLM tier's virtualenv in the background (log: $vllm_setup_log)"
    nice -n 19 bash scripts/setup_vllm.sh >"$vllm_setup_log" 2>&1 &  # lowest priority: the tests come first
    vllm_setup_pid=$!
fi
bash scripts/setup.sh
echo "test: running pytest"
status=0
# tests/vllm needs vLLM, which lives in its own virtualenv (.venv-vllm): it runs below, not here.
.venv/bin/python -m pytest tests --ignore=tests/vllm -q -rs --durations=30 "$@" || status=$?
# The vLLM engine backend's tier.
if [ -n "$vllm_setup_pid" ]; then
    setup_status=0
    wait "$vllm_setup_pid" || setup_status=$?
    cat "$vllm_setup_log"
    rm -f "$vllm_setup_log"
    echo "test: the vLLM tier's background setup ended with status $setup_status"
    # test_vllm.sh runs setup_vllm.sh again: a no-op when the background build succeeded, a retry (with its errors
    # on this console) when it did not
    bash scripts/test_vllm.sh || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
fi
exit "$status"

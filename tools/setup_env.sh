#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs what the trainer and the tests need, the first time and
# whenever a requirements file changes. Safe to run repeatedly; prints the python to use.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv="$repo/.venv"
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv with $($python --version)" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want=$(cat "$repo"/requirements*.txt "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing requirements (first run takes a few minutes)" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # torch first and alone: a CPU wheel for this exact version; anything looser pulls a multi-GB CUDA build.
  "$venv/bin/python" -m pip install --quiet "$(grep '^torch==' "$repo/requirements.txt")"
  "$venv/bin/python" -m pip install --quiet -r "$repo/requirements.txt" -r "$repo/requirements-dev.txt"
  # SGLang for CPU rollouts: its runtime dependencies (never moving a package pinned above),
  # then SGLang itself without its CUDA pins.
  constraints="$venv/constraints.txt"
  grep -hE '^[A-Za-z0-9_.-]+==' "$repo/requirements.txt" "$repo/requirements-dev.txt" > "$constraints"
  "$venv/bin/python" -m pip install --quiet -c "$constraints" -r "$repo/requirements-sglang-cpu.txt"
  "$venv/bin/python" -m pip install --quiet --no-deps -r "$repo/requirements-sglang.txt"
  "$venv/bin/python" -m pip install --quiet --no-deps -e "$repo"
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"

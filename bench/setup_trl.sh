#!/usr/bin/env bash
# Create ./.venv-trl with TRL for bench/trl_grpo.py (kept apart from ./.venv so TRL's
# dependencies never touch the project's pins). Same torch (2.13.0, CPU build first, as in
# scripts/install.sh) and the same transformers/tokenizers/safetensors/numpy as ./.venv (the
# shared pins come from requirements/constraints-cpu.txt); TRL itself pinned to 1.16.0.
#
#   bash bench/setup_trl.sh            # idempotent; VENV=/path overrides the location
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-trl}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=requirements/constraints-cpu.txt
TRL_VERSION=1.16.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

pip_install "torch==2.13.0"
TRANSFORMERS=$(sed -n 's/^transformers==//p' "$CONSTRAINTS")
pip_install -c "$CONSTRAINTS" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS"
"$VENV/bin/python" -W ignore - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} replaced 2.13.0"
from importlib.metadata import version
print(f"installed: torch {torch.__version__}, trl {version('trl')}, "
      f"transformers {version('transformers')}, accelerate {version('accelerate')}")
PY

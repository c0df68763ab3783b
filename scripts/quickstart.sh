#!/usr/bin/env bash
# The README's main job on a fresh machine: install, then a TP2 x PP2 run on 4 CPU ranks.
# (Until the RL trainer lands, the main job is the distributed forward/backward smoke run.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PYTHON=.venv/bin/python NPROC_PER_NODE=${NPROC_PER_NODE:-4} \
  scripts/torchrun.sh smoke --config configs/smoke.yaml "$@"

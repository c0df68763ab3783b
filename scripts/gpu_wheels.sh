#!/usr/bin/env bash
# Download, where pip reaches PyPI, the wheels that scripts/gpu_validate.sh needs on a GPU
# machine that has torch and transformers but no network: megatron-core and omegaconf (with
# antlr4) for its Python (default 3.12), at the versions CI tests (megatron-core: the default
# tier's, or the one named). They land in $GPU_WHEELS (default .whl/, ignored by git), which the
# validation installs into a private folder before its first stage.
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION] [MEGATRON_CORE_VERSION]
#   GPU_WHEELS=.whl/megatron-0.19.2 bash scripts/gpu_wheels.sh 3.12 0.19.2
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSION=${1:-3.12}
WHEELS=${GPU_WHEELS:-.whl}
pins=()
for name in megatron-core omegaconf antlr4-python3-runtime; do
  pins+=("$(grep -i "^$name==" requirements/constraints-cpu.txt)")
done
[ -z "${2:-}" ] || pins[0]="megatron-core==$2"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEELS" "${pins[@]}"
ls -l "$WHEELS"

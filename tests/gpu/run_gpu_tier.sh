#!/usr/bin/env bash
# Run the GPU tier on a GPU machine where atomrt is not installed (the lent H200): the top-level
# folders are linked into a temporary `atomrt` namespace on PYTHONPATH, then pytest runs.
# Usage (repo root): tests/gpu/run_gpu_tier.sh [pytest args...]   (MARK=multigpu for the 2-GPU tests)
# Logs go to $OUT (default /tmp/atomrt-gpu).
set -uo pipefail
OUT=${OUT:-/tmp/atomrt-gpu}
mkdir -p "$OUT"
pp=$(mktemp -d)
mkdir -p "$pp/atomrt"
for d in runtime workers compile graphs distributed; do ln -s "$PWD/$d" "$pp/atomrt/$d"; done
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$pp/site" .whl/*.whl
  pp="$pp:$pp/site"
fi
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -p no:cacheprovider -q -rs -m "${MARK:-gpu}" "${@:-tests/gpu}" 2>&1 | tee "$OUT/pytest-${MARK:-gpu}.log"

#!/usr/bin/env bash
# The GPU tier from a checkout, on a GPU machine where atomrt need not be installed: the top-level
# folders and atomrt/__init__.py are linked into a temporary `atomrt` package on PYTHONPATH, then
# pytest runs the tests marked gpu (default) or multigpu in tests/gpu.
# Usage (repo root): tests/gpu/run_gpu_tier.sh [pytest args...]   (MARK=multigpu for the 2-GPU tests)
# The whole tier takes longer than one 10-minute device command: SHARD=i/n runs every n-th test
# file from the i-th (1-based, files sorted by name bytewise, as on any machine), so that n
# commands cover it; each test is stopped after TEST_TIMEOUT seconds (default 120,
# pytest-timeout) and reported one line at a time (-v), so that a command cut short still shows
# what passed; a command that ends lists its 20 slowest tests (for choosing the next shards).
# torch, triton and pytest must already be importable by python3; wheels in .whl/, if any, are
# installed offline (no index, no dependencies) into the temporary path, nothing is downloaded.
# Logs go to $LOG_DIR (default /tmp/atomrt-gpu).
set -uo pipefail
LOG_DIR=${LOG_DIR:-/tmp/atomrt-gpu}
MARK=${MARK:-gpu}
mkdir -p "$LOG_DIR"
source "$(dirname "$0")/package_path.sh"
pp=$(atomrt_package "$PWD")
pp="$pp$(atomrt_wheels "$pp")"
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG_DIR/gpu.txt"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(ls tests/gpu/test_*.py | LC_ALL=C sort)
  if [ -n "${SHARD:-}" ]; then
    i=${SHARD%/*} n=${SHARD#*/}
    mapfile -t targets < <(printf '%s\n' "${targets[@]}" | awk -v i="$i" -v n="$n" '(NR - i) % n == 0')
  fi
fi
timeout_args=()
python3 -c "import pytest_timeout" 2>/dev/null && timeout_args=(--timeout "${TEST_TIMEOUT:-120}")
python3 -m pytest -p no:cacheprovider -v -rs --durations=20 -m "$MARK" "${timeout_args[@]}" "${targets[@]}" 2>&1 \
  | tee "$LOG_DIR/pytest-$MARK${SHARD:+-${SHARD/\//of}}.log"

#!/usr/bin/env bash
# One GPU session's worth of checks and figures, for a call of the device tool on nvidia-h200-x2
# (carry .whl built by ../shared/tools/gpu-wheels for Ray and pyzmq). Everything lands in $OUT:
#   pytest-gpu.log, pytest-multigpu.log, latency_*.json / .txt, tp_overhead.json, prof_*.txt
# Usage (repo root): bash tests/gpu/session.sh [quick|probe]   ("quick": the tests only; "probe":
# two step profiles, then the tests)
set -uo pipefail
export OUT=${OUT:-/tmp/atomrt-gpu}
mkdir -p "$OUT"
pp=/tmp/atomrt-ns
mkdir -p "$pp/atomrt"
for d in runtime workers compile graphs distributed; do ln -sfn "$PWD/$d" "$pp/atomrt/$d"; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$pp/site" .whl/*.whl
fi
export PYTHONPATH="$pp:$pp/site" PYTHONUNBUFFERED=1
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -4 "$OUT/$name.txt"; }
prof() { run "$1" "$2" python3 tests/gpu/profile_step.py "${@:3}"; }
if [ "${1:-}" = probe ]; then  # where the step's time goes, then the test tiers
  prof prof_135m_full_l3 70 --mode FULL --level 3
  prof prof_1b_full_l3_bs32 80 --mode FULL --level 3 --model Llama-3.2-1B --bs 32
fi
run pytest-gpu 270 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu
run pytest-multigpu 150 python3 -m pytest -p no:cacheprovider -q -rs -m multigpu tests/gpu
case "${1:-}" in quick|probe) exit 0;; esac
bench() { run "$1" "$2" python3 -m atomrt.runtime.cli bench latency --json "$OUT/$1.json" "${@:3}"; }
bench latency_135m_l3 150 --model SmolLM2-135M --level 3 --modes FULL,TR_HYBRID
bench latency_1b_l3 200 --model Llama-3.2-1B --level 3 --modes FULL,TR_HYBRID
bench latency_8b_l3 240 --model Llama-3.1-8B --level 3 --modes FULL --batch-sizes 1,8,32
bench latency_ladder512 200 --model SmolLM2-135M --level 3 --modes FULL --batch-sizes 1 --cuda-graph-sizes 512 --max-num-seqs 512
run tp_overhead 150 python3 -m atomrt.runtime.cli bench latency --compare-executors --json "$OUT/tp_overhead.json"
run transport 120 python3 -m atomrt.distributed.transport_bench --steps 10000 --bs 256
prof prof_full_l3 90 --mode FULL --level 3

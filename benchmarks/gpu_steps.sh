#!/usr/bin/env bash
# Several benchmark commands in one go within a time budget, on a GPU machine where atomrt need not
# be installed (tests/gpu/package_path.sh, as tests/gpu/run_gpu_tier.sh: the top-level folders
# linked into a temporary `atomrt` package on PYTHONPATH, wheels in .whl/ installed offline if any).
# Usage (repo root): [OUT=DIR] [BUDGET=SECONDS] benchmarks/gpu_steps.sh STEPS_FILE
# STEPS_FILE holds a step a line, `NAME SECONDS COMMAND...` (blank lines and # comments skipped).
# COMMAND runs under bash, from the repository root, with:
#   atomrt   the command line (python3 -m atomrt.runtime.entrypoints.cli)
#   $REC     a folder for records (`--record $REC`)
#   variant NAME FILE SED [FILE SED]...
#            prints a PYTHONPATH whose atomrt is a copy of the tree with those sed edits (a module's
#            constant flipped), for `VP=$(variant ...) && PYTHONPATH=$VP atomrt bench ...`; each
#            SED must change its file, or variant fails (and with `&&` the step)
# A step runs only if its SECONDS fit in what is left of BUDGET (default 570), and is stopped at
# SECONDS. Its output goes to $OUT/logs/NAME.log, a line per step to $OUT/logs/summary.txt, and at
# the end everything under $OUT (default /tmp/atomrt-steps) is packed into $OUT/all.tgz alone.
set -uo pipefail
steps_file=${1:?usage: benchmarks/gpu_steps.sh STEPS_FILE}
OUT=${OUT:-/tmp/atomrt-steps}
BUDGET=${BUDGET:-570}
root=$PWD
start=$(date +%s)
mkdir -p "$OUT/logs" "$OUT/rec"
source "$root/tests/gpu/package_path.sh"
pp=$(atomrt_package "$root")
site=$(atomrt_wheels "$pp")
export PYTHONPATH="$pp$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 REC="$OUT/rec" SITE="$site"
atomrt() { python3 -m atomrt.runtime.entrypoints.cli "$@"; }
variant() {
  local name=$1 v
  shift
  v=$(mktemp -d)/$name
  mkdir -p "$v"
  for d in runtime workers compile graphs distributed atomrt; do cp -r "$PWD/$d" "$v/$d"; done
  while [ $# -ge 2 ]; do
    cp "$v/$1" "$v/$1.orig"
    sed -i "$2" "$v/$1"
    if cmp -s "$v/$1" "$v/$1.orig"; then echo "variant $name: '$2' changed nothing in $1" >&2; return 1; fi
    shift 2
  done
  echo "$(atomrt_package "$v")$SITE"
}
export -f atomrt variant atomrt_package
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null; } > "$OUT/logs/machine.txt" 2>&1
while read -r name secs cmd; do
  case "$name" in ''|'#'*) continue ;; esac
  left=$((BUDGET - $(date +%s) + start))
  if [ "$left" -lt "$secs" ]; then
    echo "$name skipped: $secs s asked, $left s left" | tee -a "$OUT/logs/summary.txt"
    continue
  fi
  t=$(date +%s)
  timeout "$secs" bash -c "$cmd" < /dev/null > "$OUT/logs/$name.log" 2>&1
  echo "$name rc=$? $(($(date +%s) - t)) s" | tee -a "$OUT/logs/summary.txt"
  tail -n 3 "$OUT/logs/$name.log"
done < "$steps_file"
tar czf "$pp/all.tgz" -C "$OUT" logs rec && rm -rf "${OUT:?}"/* && mv "$pp/all.tgz" "$OUT/"

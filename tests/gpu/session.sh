#!/usr/bin/env bash
# A GPU session's checks and figures, for calls of the device tool (carry .whl, built by
# ../shared/tools/gpu-wheels, for Ray and pyzmq). Everything lands in $OUT as <name>.txt / .json.
# Usage (repo root): bash tests/gpu/session.sh PART...   parts, run in the order given:
#   final   (nvidia-h200-x2, ~450 s) the multigpu tier, then GPU 1 runs the quick benches (135M x2,
#           1B x2, 8B x1) while GPU 0 runs the transport bench and Ray vs in-process at level 3
#           (FULL+async), with transport_spin_us 0 and 2000; the host is shared between the two sides
#   probe   step profiles (profile_step.py) of SmolLM2-135M and Llama-3.2-1B, FULL, level 3
#   tests   the gpu tier, then the multigpu tier (needs nvidia-h200-x2)
#   full    (nvidia-h200-x2, ~570 s) the multigpu tier first, then the gpu tier on GPU 0 while the
#           quick part's 135M and 1B benches run on GPU 1 (the host is shared: say so with figures)
#   verify  (nvidia-h200-x2, ~400 s) the multigpu tier, then on GPU 0 the graph-mode, transformers,
#           argmax and skinny GEMM tests and the transport bench, while GPU 1 repeats the 135M (x3)
#           and 1B (x2) quick benches
#   dist    transport round trip, Ray vs in-process (levels 0 and 3), the 135M step profile
#   bench   atomrt bench latency: the three shapes at level 3, the 512 ladder's capture, Ray / mp vs
#           in-process at level 3, eager
#   async   async scheduling at level 3: the 135M step profile, the three shapes (sync vs async), and
#           Ray / mp vs in-process
#   kernels the skinny GEMM sweep against cuBLAS, then the rope and skinny GEMM kernel tests
#   quick   the three targets' shapes at level 3, FULL with async scheduling, one batch size each
#   diag8b  Llama-3.1-8B step profiles, FULL+async level 3, with the skinny GEMM on every weight and
#           with cuBLAS only (why the sweep's gains did not carry into the step)
#   skinny8b (one GPU, ~500 s, estimated) Llama-3.1-8B bs=1: the 8B GEMM sweeps at M=1 (qkv and gate_up with the
#           add + norm on both sides, the prologue's statistics pass narrow and wide; o and down plain),
#           then skinny_step_ab.py steps, FULL+async level 3: cuBLAS, skinny on qkv + o (wide pass,
#           narrow pass), cuBLAS again, then skinny on every weight (without, then with the SiLU-and-mul
#           in down's prologue); kernel tables for three of them. Each setting compiles into its own
#           cache root (cold the first time): the last runs may not fit one 600 s call
#   pdl     programmatic dependent launch: 135M bs=1 and 1B bs=32 with ATOMRT_PDL off and on,
#           alternating in one process (tests/gpu/ab_pdl.py), then its bitwise-equality tests
#   diag    (nvidia-h200, ~330 s) the host (tests/gpu/host_probe.py), the transport's legs (spin 0 and
#           1000 us), slow-mode rounds (tests/gpu/slow_mode.py) in four 135M and two 1B processes, and
#           the Llama-3.1-8B step profile (FULL+async, level 3)
#   abslow  slow_mode.py rounds on a baseline tree (.base, as for ab) and on this one, alternating:
#           135M bs=1 x2 each, 1B bs=32 x1 each (the median of 12 rounds of 64 steps per process)
#   abhog   as abslow, one 135M bs=1 pair only, with the step loop's thread sharing CPU 3 with a busy loop
#           (slow_mode.py --contend 3): what a slow host costs each tree
#   pair    (nvidia-h200-x2, ~500 s) GPU 0: the whole gpu tier (~270 s alone in call 5 of the seventh
#           session), then Llama-3.2-1B bs=1 steps with the NORM statistics pass narrow and wide,
#           twice; GPU 1: skinny8b (the host is shared: step timings carry that)
#   thresh  (nvidia-h200-x2, ~450 s) the skinny GEMM's weight threshold, this tree's against the old 16M
#           elements (skinny_step_ab.py, FULL+async level 3), bs 1, 2, 4, 1 (the last pair in reverse):
#           Llama-3.1-8B on GPU 1 then its bench latency at bs 1, 2, 4; Llama-3.2-1B on GPU 0, then
#           the skinny GEMM tests and the 135M (bs 1) and 1B (bs 1, 4, 32) benches
#   m1      (one GPU, ~450 s) the single-row threshold: Llama-3.1-8B's bench at bs 1, 2, 4; Llama-3.2-1B
#           bs=1 on this tree against 16M elements at every batch size (ABBA); the skinny GEMM tests;
#           the 135M (bs 1) and 1B (bs 1, 32) benches
#   tier2   (nvidia-h200-x2, ~450 s) the gpu tier split over both GPUs, then the multigpu tier
#   mid     (nvidia-h200-x2, ~350 s) GPU 0: ab_pdl.py on Llama-3.1-8B bs=1; GPU 1: quick 135M x2 and 1B,
#           then Ray vs in-process at the default transport_spin_us (auto), then the transport bench
#   abpar   (nvidia-h200-x2) GPU 1 runs the quick 135M / 1B benches on .base and this tree in ABBA order,
#           while GPU 0 runs the gpu tests in $AB_TESTS, then bench_decode_attention.py --variants
#   ab      the quick part's 135M and 1B shapes on a baseline tree and on this one, alternating, in
#           one call (figures from different calls land on different machines and can differ by more
#           than a change): make the baseline with
#             mkdir .base && git archive REV runtime workers compile graphs distributed | tar -x -C .base
#           (.base is git-ignored through .git/info/exclude) and carry it with .whl
set -uo pipefail
export OUT=${OUT:-/tmp/atomrt-gpu}
mkdir -p "$OUT"
pp=/tmp/atomrt-ns
mkdir -p "$pp/atomrt"
for d in runtime workers compile graphs distributed; do ln -sfn "$PWD/$d" "$pp/atomrt/$d"; done
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d "$pp/site/ray" ]; then  # once per machine: a second install
  # while another part of the call imports from $pp/site could break that import
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$pp/site" .whl/*.whl
fi
export PYTHONPATH="$pp:$pp/site" PYTHONUNBUFFERED=1
# Which machine: figures differ between calls by more than a change (the runtime, gVisor or
# Firecracker, shows in the kernel release; host speed in the cores' model).
echo "machine: kernel $(uname -r), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -4 "$OUT/$name.txt"; }
prof() { run "$1" "$2" python3 tests/gpu/profile_step.py "${@:3}"; }
bench() { run "$1" "$2" python3 -m atomrt.runtime.entrypoints.cli bench latency --json "$OUT/$1.json" "${@:3}"; }
# thr_ab MODEL TAG "TREE BS"...: skinny_step_ab.py decode steps, in order, each in its own process;
# TREE new: this tree's skinny thresholds, old: 16M elements at every batch size (before f2777b9)
thr_ab() {
  local model=$1 tag=$2 i=0 tree bs pick; shift 2
  for pick in "$@"; do
    read -r tree bs <<< "$pick"; i=$((i + 1))
    local set=(--setting default)
    [ "$tree" = old ] && set=(--setting skinny --max-weight-elems $((1 << 24)))
    ATOMRT_CACHE_ROOT=/tmp/cache_$tree run "${tag}_${i}_${tree}_bs$bs" 100 python3 tests/gpu/skinny_step_ab.py \
      --model "$model" --bs "$bs" "${set[@]}"
  done
  grep -h "^==" "$OUT/${tag}"_*.txt
}
for part in "$@"; do
  case "$part" in
    full)
      run pytest-multigpu 250 python3 -m pytest -p no:cacheprovider -q -rA --tb=long -m multigpu tests/gpu
      ( export CUDA_VISIBLE_DEVICES=1
        bench quick_135m 100 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1
        bench quick_1b 110 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 32 ) > "$OUT/side.log" 2>&1 &
      side=$!  # waited for by pid: a pgrep -f pattern also matches this script's own command line
      CUDA_VISIBLE_DEVICES=0 run pytest-gpu 310 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu
      wait "$side"; cat "$OUT/side.log" ;;
    verify)
      run pytest-multigpu 250 python3 -m pytest -p no:cacheprovider -q -rA --tb=long -m multigpu tests/gpu
      ( export CUDA_VISIBLE_DEVICES=1
        for r in 1 2 3; do bench "quick_135m_$r" 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1; done
        for r in 1 2; do bench "quick_1b_$r" 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 32; done
      ) > "$OUT/side.log" 2>&1 &
      side=$!
      CUDA_VISIBLE_DEVICES=0 run pytest-verify 250 python3 -m pytest -p no:cacheprovider -q -rs -m gpu \
        tests/gpu/test_graph_modes_gpu.py tests/gpu/test_models_hf_gpu.py tests/gpu/test_argmax_gpu.py \
        tests/gpu/test_skinny_gemm_gpu.py
      CUDA_VISIBLE_DEVICES=0 run transport 60 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256
      wait "$side"; cat "$OUT/side.log" ;;
    final)
      run pytest-multigpu 250 python3 -m pytest -p no:cacheprovider -q -rA --tb=long -m multigpu tests/gpu
      ( export CUDA_VISIBLE_DEVICES=1
        for r in 1 2; do bench "quick_135m_$r" 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1; done
        for r in 1 2; do bench "quick_1b_$r" 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 32; done
        bench quick_8b 120 --model Llama-3.1-8B --level 3 --modes FULL+async --batch-sizes 1
      ) > "$OUT/side.log" 2>&1 &
      side=$!
      ( export CUDA_VISIBLE_DEVICES=0
        run transport 60 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256
        for spin in 0 2000; do
          run "tp_overhead_l3_spin$spin" 120 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --level 3 \
            --modes FULL+async --executor inproc,ray --transport-spin-us "$spin" --json "$OUT/tp_overhead_l3_spin$spin.json"
        done )
      wait "$side"; cat "$OUT/side.log" ;;
    probe)
      prof prof_135m_full_l3 70 --mode FULL --level 3
      prof prof_1b_full_l3_bs32 80 --mode FULL --level 3 --model Llama-3.2-1B --bs 32 ;;
    tests)
      run pytest-gpu 340 python3 -m pytest -p no:cacheprovider -q -rs -s -m gpu tests/gpu
      run pytest-multigpu 260 python3 -m pytest -p no:cacheprovider -q -rA --tb=long -m multigpu tests/gpu ;;
    dist)
      run transport 90 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256
      run tp_overhead_l0 100 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --json "$OUT/tp_overhead_l0.json"
      run tp_overhead_l3 120 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --level 3 --json "$OUT/tp_overhead_l3.json"
      prof prof_135m_full_l3 70 --mode FULL --level 3 ;;
    bench)
      bench latency_135m_l3 80 --model SmolLM2-135M --level 3 --modes FULL,TR_HYBRID
      bench latency_ladder512 60 --model SmolLM2-135M --level 3 --modes FULL --batch-sizes 1 --cuda-graph-sizes 512 --max-num-seqs 512
      bench latency_1b_l3 120 --model Llama-3.2-1B --level 3 --modes FULL,TR_HYBRID
      bench latency_8b_l3 120 --model Llama-3.1-8B --level 3 --modes FULL
      run tp_overhead_l3 100 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --level 3 --executor inproc,mp,ray --json "$OUT/tp_overhead_l3.json"
      bench latency_eager 70 --modes eager --decode-steps 8 ;;
    async)
      prof prof_135m_full_l3_async 80 --mode FULL --level 3 --async-scheduling
      bench async_135m_l3 100 --model SmolLM2-135M --level 3 --modes FULL,FULL+async,TR_HYBRID+async
      bench async_1b_l3 110 --model Llama-3.2-1B --level 3 --modes FULL,FULL+async
      bench async_8b_l3 110 --model Llama-3.1-8B --level 3 --modes FULL+async --batch-sizes 1
      run async_tp_overhead_l3 150 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --level 3 --modes FULL+async --executor inproc,mp,ray --json "$OUT/async_tp_overhead_l3.json" ;;
    kernels)
      run sweep_gemm 170 python3 tests/gpu/sweep_gemm.py --budget-s 110 --json "$OUT/sweep_gemm.json"
      run pytest-kernels 150 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu/test_kernels_gpu.py::test_rope_write_kv tests/gpu/test_skinny_gemm_gpu.py ;;
    quick)
      bench quick_135m 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1
      bench quick_1b 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 32
      bench quick_8b 110 --model Llama-3.1-8B --level 3 --modes FULL+async --batch-sizes 1 ;;
    diag8b)
      prof prof_8b_skinny_all 110 --mode FULL --level 3 --async-scheduling --model Llama-3.1-8B --skinny-max-weight-elems $((1 << 40))
      prof prof_8b_cublas 110 --mode FULL --level 3 --async-scheduling --model Llama-3.1-8B --skinny-max-weight-elems 0 ;;
    skinny8b)
      sw=(python3 tests/gpu/sweep_gemm.py --ms 1 --budget-s 45)
      run sweep_norm_pass0 80 "${sw[@]}" --norm --shapes "8B qkv,8B gate_up" --stats-values 0 \
        --json "$OUT/sweep_norm_pass0.json"
      run sweep_norm 80 "${sw[@]}" --norm --shapes "8B qkv,8B gate_up" --json "$OUT/sweep_norm.json"
      run sweep_plain 80 "${sw[@]}" --shapes "8B o,8B down" --json "$OUT/sweep_plain.json"
      ab=(python3 tests/gpu/skinny_step_ab.py --model Llama-3.1-8B --bs 1)
      sj="$OUT/sweep_plain.json,$OUT/sweep_norm.json"
      qkv_o=(--setting skinny --max-weight-elems $((1 << 25)) --sweep-json "$sj")
      ATOMRT_CACHE_ROOT=/tmp/cache_cublas run step_cublas_1 130 "${ab[@]}" --setting default
      ATOMRT_CACHE_ROOT=/tmp/cache_qkv_o run step_qkv_o 130 "${ab[@]}" "${qkv_o[@]}" --kernels
      ATOMRT_CACHE_ROOT=/tmp/cache_qkv_o run step_qkv_o_pass0 90 "${ab[@]}" "${qkv_o[@]}" --stats-values 0
      ATOMRT_CACHE_ROOT=/tmp/cache_cublas run step_cublas_2 90 "${ab[@]}" --setting default --kernels
      # extras, last: a call cut at its limit loses these first
      ATOMRT_CACHE_ROOT=/tmp/cache_all run step_all 130 "${ab[@]}" --setting skinny --max-weight-elems $((1 << 40)) \
        --sweep-json "$sj" --kernels
      ATOMRT_CACHE_ROOT=/tmp/cache_gated run step_all_gated 110 "${ab[@]}" --setting skinny \
        --max-weight-elems $((1 << 40)) --gated-max-weight-elems $((1 << 40)) --sweep-json "$sj"
      grep -h "^==" "$OUT"/step_*.txt ;;
    pdl)
      run ab_pdl 330 python3 tests/gpu/ab_pdl.py --out /tmp/ab_pdl
      run pytest-pdl 230 python3 -m pytest -p no:cacheprovider -q -rA --tb=short -m gpu tests/gpu/test_pdl_gpu.py ;;
    diag)
      run host_probe 60 python3 tests/gpu/host_probe.py
      run transport_spin0 60 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256
      run transport_spin1000 60 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256 --spin-us 1000
      for r in 1 2 3 4; do run "slow_135m_$r" 60 python3 tests/gpu/slow_mode.py; done
      for r in 1 2; do run "slow_1b_$r" 80 python3 tests/gpu/slow_mode.py --model Llama-3.2-1B --bs 32; done
      prof prof_8b_full_l3_async 120 --mode FULL --level 3 --async-scheduling --model Llama-3.1-8B --steps 100 ;;
    abslow|abhog)
      [ -d .base/workers ] || { echo "abslow: no .base tree (see ab)"; exit 2; }
      bp=/tmp/atomrt-base
      mkdir -p "$bp/atomrt"
      for d in runtime workers compile graphs distributed; do ln -sfn "$PWD/.base/$d" "$bp/atomrt/$d"; done
      shapes=("SmolLM2-135M 1" "Llama-3.2-1B 32" "SmolLM2-135M 1"); extra=(); tag=abslow
      [ "$part" = abhog ] && { shapes=("SmolLM2-135M 1"); extra=(--contend 3); tag=abhog; }
      for shape in "${shapes[@]}"; do
        read -r model bs <<< "$shape"
        for tree in base head; do
          root=$pp; [ "$tree" = base ] && root=$bp
          name="${tag}_${tree}_${model}_$RANDOM"
          PYTHONPATH="$root:$pp/site" timeout 90 python3 tests/gpu/slow_mode.py --model "$model" --bs "$bs" "${extra[@]}" \
            > "$OUT/$name.txt" 2>&1
          echo "== $name rc=$?"; tail -1 "$OUT/$name.txt"
        done
      done ;;
    ab)
      [ -d .base/workers ] || { echo "ab: no .base tree (see the header)"; exit 2; }
      bp=/tmp/atomrt-base
      mkdir -p "$bp/atomrt"
      for d in runtime workers compile graphs distributed; do ln -sfn "$PWD/.base/$d" "$bp/atomrt/$d"; done
      for shape in "SmolLM2-135M 1" "Llama-3.2-1B 32"; do
        read -r model bs <<< "$shape"
        for tree in base head; do
          root=$pp; [ "$tree" = base ] && root=$bp
          name="ab_${tree}_${model}"
          PYTHONPATH="$root:$pp/site" timeout 110 python3 -m atomrt.runtime.entrypoints.cli bench latency --json "$OUT/$name.json" \
            --model "$model" --level 3 --modes FULL+async --batch-sizes "$bs" > "/tmp/$name.txt" 2>&1
          echo "== $name rc=$?"; tail -1 "/tmp/$name.txt"
        done
      done ;;
    abpar)
      [ -d .base/workers ] || { echo "abpar: no .base tree (see ab)"; exit 2; }
      bp=/tmp/atomrt-base
      mkdir -p "$bp/atomrt"
      for d in runtime workers compile graphs distributed; do ln -sfn "$PWD/.base/$d" "$bp/atomrt/$d"; done
      ( export CUDA_VISIBLE_DEVICES=1
        for run in "base SmolLM2-135M 1" "head SmolLM2-135M 1" "head Llama-3.2-1B 32" "base Llama-3.2-1B 32" \
                   "head SmolLM2-135M 1" "base SmolLM2-135M 1"; do
          read -r tree model bs <<< "$run"
          root=$pp; [ "$tree" = base ] && root=$bp
          name="abpar_${tree}_${model}_$RANDOM"
          PYTHONPATH="$root:$pp/site" timeout 110 python3 -m atomrt.runtime.entrypoints.cli bench latency --json "$OUT/$name.json" \
            --model "$model" --level 3 --modes FULL+async --batch-sizes "$bs" > "$OUT/$name.txt" 2>&1
          echo "== $name rc=$?"; tail -1 "$OUT/$name.txt"
        done ) > "$OUT/side.log" 2>&1 &
      side=$!
      ( export CUDA_VISIBLE_DEVICES=0
        run pytest-abpar 330 python3 -m pytest -p no:cacheprovider -q -rs -x -m gpu ${AB_TESTS:-tests/gpu/test_decode_attention_gpu.py}
        run attn_variants 150 python3 tests/gpu/bench_decode_attention.py --variants --json "$OUT/attn_variants.json" )
      wait "$side"; cat "$OUT/side.log" ;;
    mid)
      ( export CUDA_VISIBLE_DEVICES=1
        for r in 1 2; do bench "quick_135m_$r" 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1; done
        bench quick_1b 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 32
        run tp_overhead_l3_auto 130 python3 -m atomrt.runtime.entrypoints.cli bench latency --compare-executors --level 3 \
          --modes FULL+async --executor inproc,ray --json "$OUT/tp_overhead_l3_auto.json"
        run transport 60 python3 -m atomrt.runtime.bench.transport --steps 10000 --bs 256
      ) > "$OUT/side.log" 2>&1 &
      side=$!
      CUDA_VISIBLE_DEVICES=0 run ab_pdl_8b 330 python3 tests/gpu/ab_pdl.py --model Llama-3.1-8B:1 --rounds 2
      wait "$side"; cat "$OUT/side.log" ;;
    pair)
      ( export CUDA_VISIBLE_DEVICES=1; bash "$0" skinny8b ) > "$OUT/side.log" 2>&1 &
      side=$!
      ( export CUDA_VISIBLE_DEVICES=0
        run pytest-gpu 400 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu
        for r in 1 2; do  # the default path's NORM projections with K above one K tile: 1B qkv at bs=1
          for v in 0 4096; do
            run "step_1b_pass${v}_$r" 70 python3 tests/gpu/skinny_step_ab.py --model Llama-3.2-1B --bs 1 \
              --setting default --stats-values "$v"
          done
        done
        grep -h "^==" "$OUT"/step_1b_*.txt )
      wait "$side"; cat "$OUT/side.log" ;;
    thresh)
      ( export CUDA_VISIBLE_DEVICES=1; THR=8B bash "$0" thresh_side ) > "$OUT/side.log" 2>&1 &
      side=$!
      ( export CUDA_VISIBLE_DEVICES=0; THR=1B bash "$0" thresh_side
        run pytest-skinny 150 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu/test_skinny_gemm_gpu.py
        bench quick_135m 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1
        bench quick_1b 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 1,4,32 )
      wait "$side"; cat "$OUT/side.log" ;;
    thresh_side)  # (one GPU; THR=8B or THR=1B) the skinny threshold, this tree's against 16M elements
      model=Llama-3.1-8B; [ "${THR:?}" = 1B ] && model=Llama-3.2-1B
      thr_ab "$model" "thr_$THR" "new 1" "old 1" "new 2" "old 2" "new 4" "old 4" "old 1" "new 1"
      [ "$THR" = 8B ] && bench quick_8b 120 --model Llama-3.1-8B --level 3 --modes FULL+async --batch-sizes 1,2,4 ;;
    m1)
      bench quick_8b 130 --model Llama-3.1-8B --level 3 --modes FULL+async --batch-sizes 1,2,4
      thr_ab Llama-3.2-1B m1_1B "new 1" "old 1" "old 1" "new 1"
      run pytest-skinny 150 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu/test_skinny_gemm_gpu.py
      bench quick_135m 80 --model SmolLM2-135M --level 3 --modes FULL+async --batch-sizes 1
      bench quick_1b 100 --model Llama-3.2-1B --level 3 --modes FULL+async --batch-sizes 1,32 ;;
    tier2)
      ( CUDA_VISIBLE_DEVICES=1 run pytest-gpu1 330 python3 -m pytest -p no:cacheprovider -q -rs -m gpu \
          tests/gpu/test_models_hf_gpu.py tests/gpu/test_region_graph_gpu.py tests/gpu/test_skinny_gemm_gpu.py \
          tests/gpu/test_pdl_gpu.py ) > "$OUT/side.log" 2>&1 &
      side=$!
      CUDA_VISIBLE_DEVICES=0 run pytest-gpu0 330 python3 -m pytest -p no:cacheprovider -q -rs -m gpu \
        tests/gpu/test_graph_modes_gpu.py tests/gpu/test_argmax_gpu.py tests/gpu/test_decode_attention_gpu.py \
        tests/gpu/test_kernels_gpu.py
      wait "$side"; cat "$OUT/side.log"
      run pytest-multigpu 250 python3 -m pytest -p no:cacheprovider -q -rA --tb=long -m multigpu tests/gpu ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

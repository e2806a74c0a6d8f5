#!/usr/bin/env bash
# The engine-speed run on the device machine, from the repo root: TileLang from .carry/, the GPU
# tests of CUDA graphs, the sync-free step and asynchronous scheduling, one profiled decode step
# (kernels, syncs, GPU-busy share; .carry/tools/gpu_step_profile.py, copied from ../shared/tools),
# then experiments/bench_engine.py (stopped BENCH_UNTIL seconds after the start, default 590; the
# CSV holds every section finished by then). Logs and results go to $OUT.
#   bash experiments/bench_engine_h200_run.sh [tests] [profile] [bench] [bench arguments...]
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
stages=""
while [[ $# -gt 0 && $1 =~ ^(tests|profile|bench)$ ]]; do stages="$stages $1"; shift; done
stages=${stages:-tests profile bench}
sm100="backend.fallback=reference model.dtype=bfloat16"
if [[ $stages == *tests* ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/engine/test_cuda_graphs.py \
    tests/engine/test_sync_free.py tests/engine/test_async_scheduling.py -k gpu >"$out/engine_gpu_pytest.log" 2>&1
  grep -E "^(E |FAILED|PASSED|[0-9]+ (passed|failed))|Error" "$out/engine_gpu_pytest.log" | head -30
  echo "tests done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *profile* ]]; then
  for batch in 1 64; do
    timeout 200 python3 .carry/tools/gpu_step_profile.py --model small --backend sm100 --batch $batch \
      >"$out/profile_small_b$batch.txt" 2>&1
    head -1 "$out/profile_small_b$batch.txt"
  done
  echo "profile done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *bench* ]]; then
  timeout $(( ${BENCH_UNTIL:-590} - ($(date +%s) - start) )) python3 experiments/bench_engine.py "$@" $sm100 2>&1 \
    | grep -v "it/s\]" | tee "$out/bench_engine.log" | tail -60
  cp experiments/results/bench_engine_* "$out/" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"

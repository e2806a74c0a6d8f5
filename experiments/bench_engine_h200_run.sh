#!/usr/bin/env bash
# The engine-speed run on the device machine, from the repo root: TileLang from .carry/, the GPU
# tests (the sm100 Triton kernels against the reference and batch-invariant, then CUDA graphs, the
# sync-free launch and asynchronous scheduling), one profiled decode step per batch size of `profile`
# (.carry/tools/gpu_step_profile.py, copied from ../shared/tools), then
# experiments/bench_engine.py with the given arguments (stopped BENCH_UNTIL seconds after the
# start, default 590; its CSV holds every row measured by then). Logs and results go to $OUT.
#   bash experiments/bench_engine_h200_run.sh [tests] [profile] [bench] [bench arguments...]
# The recorded run (experiments/results/bench_engine_h200.*):
#   bash experiments/bench_engine_h200_run.sh tests bench study.reference_batches=[1,16] \
#     study.compare_async=true study.dspark_model=tiny study.hf=true study.steps=16
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
  triton_ops="mhc or apply_rope or ep_combine or kv_load or swiglu or indexer_logits"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/hal/test_parity.py \
    tests/backends/test_sm100_fused.py tests/backends/test_sm100_gpu_invariance.py \
    -k "(sm100 and ($triton_ops)) or interpreter or (($triton_ops) and bits)" >"$out/triton_gpu_pytest.log" 2>&1
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/engine/test_cuda_graphs.py \
    tests/engine/test_sync_free.py tests/engine/test_async_scheduling.py -k gpu >"$out/engine_gpu_pytest.log" 2>&1
  grep -hE "^(E |FAILED|PASSED|[0-9]+ (passed|failed))|Error" "$out/triton_gpu_pytest.log" "$out/engine_gpu_pytest.log" \
    | head -30
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
  timeout $(( ${BENCH_UNTIL:-590} - ($(date +%s) - start) )) python3 experiments/bench_engine.py study.tag=h200 "$@" $sm100 \
    2>&1 | grep -v "it/s\]\|TileLang\|lacks it\|_warn_once\|acc_events" | tee "$out/bench_engine.log" | tail -80
  cp experiments/results/bench_engine_* "$out/" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"

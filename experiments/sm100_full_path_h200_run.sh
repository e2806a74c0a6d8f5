#!/usr/bin/env bash
# The sm100 full-path run on the device machine, from the repo root: every sm100 Triton op against the
# reference on the GPU (the parity grid, no fallback), the weight_format parity of model=small
# (experiments/weight_format_parity.py), then experiments/bench_engine.py for sm100 alone with no fallback
# (so an op sm100 lacks fails the run). Logs and results go to $OUT.
#   bash experiments/sm100_full_path_h200_run.sh [parity] [weights] [bench] [bench arguments...]
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
stages=""
while [[ $# -gt 0 && $1 =~ ^(parity|weights|bench)$ ]]; do stages="$stages $1"; shift; done
if [[ $stages == *parity* ]]; then
  ops="moe_gate or ep_dispatch or ep_combine or compress_tokens or indexer_topk or swa_ or sample or speculative_accept"
  ops="$ops or apply_token_bitmask or apply_rope or mhc or kv_load or swiglu"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/hal/test_parity.py -k "sm100 and ($ops)" \
    >"$out/parity_pytest.log" 2>&1
  grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/parity_pytest.log" | head -40
  echo "parity done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *weights* ]]; then
  timeout 300 python3 experiments/weight_format_parity.py --model small --formats none mxfp4 fp8 --commit "${COMMIT:-}" \
    2>&1 | grep -v "TileLang\|_warn_once" | tee "$out/weight_format_parity.log" | tail -40
  cp experiments/results/weight_format_parity_* "$out/" 2>/dev/null
  echo "weights done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *bench* ]]; then
  timeout $(( ${BENCH_UNTIL:-590} - ($(date +%s) - start) )) python3 experiments/bench_engine.py --tag h200_full_path \
    --backends sm100 "$@" model.dtype=bfloat16 2>&1 | grep -v "it/s\]\|TileLang\|_warn_once\|acc_events" \
    | tee "$out/bench_engine.log" | tail -60
  cp experiments/results/bench_engine_h200_full_path* "$out/" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"

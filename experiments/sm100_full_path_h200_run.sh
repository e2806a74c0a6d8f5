#!/usr/bin/env bash
# The sm100 full-path run on the device machine, from the repo root: every sm100 Triton op against the
# reference on the GPU (the parity grid, no fallback), the weight_format parity of model=small
# (experiments/weight_format_parity.py), the block-scaled grouped GEMM's compute-bound points against the
# dense FP8 rate of torch._scaled_mm (experiments/bench_ops.py), the decode linears against cuBLAS
# and stacked where they share their input, against the Triton kernel for few rows (experiments/linear_stacked.py), the bf16 grouped GEMM kernels at model=small's decode shapes (GEMM_POINTS, comma-separated label parts of
# experiments/grouped_gemm_kernels.py), then experiments/bench_engine.py for sm100 alone with no fallback (so an
# op sm100 lacks fails the run). PARITY_OPS (a pytest -k expression) narrows the parity stage, PARITY_TIMEOUT
# (seconds, default 240) bounds it. Logs and results go to $OUT.
# The wgmma stage runs the native-FP8 grouped GEMM's check and sweep (kernels/experimental/grouped_gemm_fp8_wgmma.py).
#   bash experiments/sm100_full_path_h200_run.sh [parity] [weights] [fp8] [wgmma] [linear] [gemm] [bench] [bench arguments...]
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
stages=""
while [[ $# -gt 0 && $1 =~ ^(parity|weights|fp8|wgmma|linear|gemm|bench)$ ]]; do stages="$stages $1"; shift; done
if [[ $stages == *parity* ]]; then
  python3 -m deepinfer_backends.sm100.fused.tile_schedule 2>&1 | tail -5
  ops="moe_gate or ep_dispatch or ep_combine or compress_tokens or indexer_topk or swa_ or sample or speculative_accept"
  ops="${PARITY_OPS:-$ops or apply_token_bitmask or apply_rope or mhc or kv_load or swiglu}"
  timeout ${PARITY_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/hal/test_parity.py -k "sm100 and ($ops)" \
    >"$out/parity_pytest.log" 2>&1
  grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/parity_pytest.log" | head -40
  echo "parity done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *weights* ]]; then
  timeout 300 python3 experiments/weight_format_parity.py "study.formats=[$(echo ${WEIGHT_FORMATS:-none mxfp4 fp8} | tr ' ' ,)]" \
    2>&1 | grep -v "TileLang\|_warn_once" | tee "$out/weight_format_parity.log" | tail -40
  cp experiments/results/weight_format_parity_* "$out/" 2>/dev/null
  echo "weights done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *fp8* ]]; then
  timeout 200 python3 experiments/bench_ops.py study.sweep=full study.jobs=8 study.output_dir="$out" \
    study.only=[moe_e384_t4096_ep8_fp8_fp8,moe_e384_t4096_ep1_fp8_fp8,moe_e384_t16384_ep8_w2_fp8_fp8,moe_e384_t16384_ep8_w2_fp8_mxfp4] 2>&1 \
    | grep -v "TileLang\|_warn_once" | tee "$out/fp8_gemm.log" | tail -12
  echo "fp8 done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *wgmma* ]]; then
  timeout ${WGMMA_TIMEOUT:-240} python3 -m deepinfer_backends.sm100.kernels.experimental.grouped_gemm_fp8_wgmma 2>&1 \
    | grep -v "TileLang\|_warn_once" | tee "$out/fp8_wgmma.log" | tail -30
  echo "wgmma done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *linear* ]]; then
  python3 -m deepinfer_backends.sm100.fused.linear_skinny 2>&1 | tail -5
  timeout 200 python3 experiments/linear_stacked.py study.output_dir="$out" 2>&1 | grep -v "TileLang\|_warn_once" \
    | tee "$out/linear_stacked.log" | tail -32
  echo "linear done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *gemm* ]]; then
  python3 -m deepinfer_backends.sm100.fused.grouped_gemm_skinny 2>&1 | tail -5
  timeout 200 python3 experiments/grouped_gemm_kernels.py study.output_dir="$out" "study.only=[${GEMM_POINTS:-small,'EP8 T=256'}]" \
    "study.kernels=['triton skinny','ws 64x256 s4']" 2>&1 | grep -v "TileLang\|_warn_once" | tee "$out/grouped_gemm.log" \
    | tail -24
  echo "gemm done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *bench* ]]; then
  timeout $(( ${BENCH_UNTIL:-590} - ($(date +%s) - start) )) python3 experiments/bench_engine.py study.tag=h200_full_path \
    study.reference=false "$@" model.dtype=bfloat16 2>&1 | grep -v "it/s\]\|TileLang\|_warn_once\|acc_events" \
    | tee "$out/bench_engine.log" | tail -60
  cp experiments/results/bench_engine_h200_full_path* "$out/" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"

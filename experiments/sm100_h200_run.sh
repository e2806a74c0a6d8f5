#!/usr/bin/env bash
# The sm100 GPU session in one command, run from the repo root on the device machine: unpack the
# carried TileLang (made by ../shared/tools/pack_tilelang.sh into .carry/) and wheels, then the
# chosen stages; logs and results go to $OUT.
#   parity  the parity grid with numbers (python -m deepinfer task=parity backend_b=sm100; PARITY_OPS="op ..." limits it)
#   checks  the kernels' own self-checks (bytes of the fused KV store, quantized grouped GEMM)
#   invariance  the sm100 batch-invariant table, op by op (tests/backends/test_sm100_gpu_invariance.py)
#   bench   the op benchmark (experiments/bench_ops.py study.sweep=$SWEEP, default quick; BENCH_ONLY="name part ...")
#   cost    the decode cost of engine.batch_invariant on sm100 (experiments/invariance_cost.py)
#   mla     the sparse MLA kernels side by side on bench_ops's decode and prefill points (experiments/mla_kernels.py)
#   gemm    the grouped GEMM kernels side by side on the MoE shapes (experiments/grouped_gemm_kernels.py;
#           GEMM_FORMATS="bf16 fp8:mxfp4 ..." picks the operand formats, default bf16)
#   ncu     where the MLA decode kernel's time goes
#   bash experiments/sm100_h200_run.sh [stages...]   (default: parity bench ncu)
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
left() { echo $(( ${LIMIT:-580} - ($(date +%s) - start) )); }
TILELANG=1 source experiments/device_setup.sh
echo "setup $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/card.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" | tee -a "$out/card.txt"
stages=${*:-parity bench ncu}
if [[ $stages == *parity* ]]; then
  timeout 240 python3 -m deepinfer task=parity backend_b=sm100 generate_tokens=0 output_dir="$out" ${PARITY_OPS:+"ops=[${PARITY_OPS// /,}]"} >"$out/parity.log" 2>&1
  grep -v TileLang "$out/parity.log" | grep -E " (pass|fail|error) " | head -60
  echo "parity done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *checks* ]]; then
  for module in kv_norm_rope_store grouped_gemm_quant; do
    timeout 120 python3 -m deepinfer_backends.sm100.kernels.$module ${CHECK_ARGS:-} 2>&1 | grep -v "TileLang" \
      | tail -14 | tee "$out/check_$module.log"
  done
  echo "checks done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *invariance* ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rA --tb=short tests/backends/test_sm100_gpu_invariance.py \
    >"$out/gpu_invariance.log" 2>&1
  grep -E "^(E |FAILED|PASSED|[0-9]+ (passed|failed))" "$out/gpu_invariance.log" | head -40
  echo "invariance done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *bench* ]]; then
  reserve=0; [[ $stages == *cost* ]] && reserve=90
  timeout $(( $(left) - reserve )) python3 experiments/bench_ops.py study.sweep="${SWEEP:-quick}" study.output_dir="$out" \
    ${BENCH_ONLY:+"study.only=[${BENCH_ONLY// /,}]"} \
    >"$out/bench.log" 2>&1
  grep -v "^compiled .*: ok" "$out/bench.log" | tail -60
  echo "bench done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *mla* ]]; then
  timeout 400 python3 experiments/mla_kernels.py study.output_dir="$out" >"$out/mla_kernels.log" 2>&1
  grep -E "^(decode|prefill|NVIDIA)" "$out/mla_kernels.log" | tail -40
  echo "mla done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *gemm* ]]; then
  timeout 400 python3 experiments/grouped_gemm_kernels.py "study.formats=[$(echo ${GEMM_FORMATS:-bf16} | tr ' ' ,)]" study.output_dir="$out" >"$out/grouped_gemm_kernels.log" 2>&1
  grep -E "^(edge|bf16|fp8|NVIDIA)" "$out/grouped_gemm_kernels.log" | tail -40
  echo "gemm done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *cost* ]]; then
  timeout $(( $(left) )) python3 experiments/invariance_cost.py study.repeats=3 backend=sm100 study.tag=sm100 \
    backend.fallback=reference model.dtype=bfloat16 2>&1 | tail -6
  cp experiments/results/invariance_cost_cuda_sm100.csv "$out/" 2>/dev/null
fi
if [[ $stages == *ncu* ]] && [ "$(left)" -gt 60 ] && command -v ncu >/dev/null; then
  timeout $(( $(left) - 10 )) ncu --clock-control none -k regex:kernel_kernel -c 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 -m deepinfer_backends.sm100.kernels.mla_sparse_decode >"$out/ncu_decode.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Occupancy|Registers|Shared Memory Config|Warp Cycles|Eligible" "$out/ncu_decode.txt" | head -40
fi
echo "total $(( $(date +%s) - start )) s"

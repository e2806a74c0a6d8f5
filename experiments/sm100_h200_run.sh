#!/usr/bin/env bash
# The sm100 GPU session in one command, run from the repo root on the device machine: unpack the
# carried TileLang (made by ../shared/tools/pack_tilelang.sh into .carry/) and wheels, then the
# sm100 parity grid (pytest, then the numbers) and the op benchmark. Logs and results go to $OUT.
#   bash experiments/sm100_h200_run.sh [quick|full]
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
echo "setup $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/card.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" | tee -a "$out/card.txt"
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/hal/test_parity.py -k sm100 2>&1 \
  | tail -40 | tee "$out/parity_pytest.log"
echo "parity pytest done at $(( $(date +%s) - start )) s"
timeout 120 python3 experiments/sm100_parity.py --out "$out" >"$out/parity.log" 2>&1
tail -3 "$out/parity.log"
echo "parity numbers done at $(( $(date +%s) - start )) s"
timeout $(( 540 - ($(date +%s) - start) )) python3 experiments/bench_ops.py --sweep "${1:-quick}" --out "$out" \
  >"$out/bench.log" 2>&1
grep -v "^compiled .*: ok" "$out/bench.log" | tail -60
left=$(( 570 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ] && command -v ncu >/dev/null; then  # where the decode kernel's time goes
  timeout $(( left - 10 )) ncu --clock-control none -k regex:kernel_kernel -c 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 -m deepinfer_backends.sm100.kernels.mla_sparse_decode >"$out/ncu_decode.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Occupancy|Registers|Shared Memory Config|Warp Cycles|Eligible" "$out/ncu_decode.txt" | head -40
fi
echo "total $(( $(date +%s) - start )) s"

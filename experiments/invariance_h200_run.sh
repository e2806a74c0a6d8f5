#!/usr/bin/env bash
# Batch invariance on the GPU in one command (repo root, device machine, reference backend on
# CUDA): the end-to-end invariance tests (plain and DSpark, plus the counted differences with the
# mode off) and the decode cost of the mode, without and with DSpark drafts.
#   bash experiments/invariance_h200_run.sh
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
timeout 400 python3 -m pytest -q -p no:cacheprovider --runslow -rA -k cuda tests/engine/test_batch_invariance.py 2>&1 \
  | grep -v "it/s\]" | tail -25 | tee "$out/invariance_pytest.log"
echo "tests done at $(( $(date +%s) - start )) s"
timeout 120 python3 experiments/invariance_cost.py study.repeats=3 backend.device=cuda 2>&1 | tail -5
timeout $(( 570 - ($(date +%s) - start) )) python3 experiments/invariance_cost.py study.repeats=3 study.tag=dspark \
  backend.device=cuda decoding=dspark decoding.varlen=false 2>&1 | tail -5
cp experiments/results/invariance_cost_cuda*.csv "$out/" 2>/dev/null
echo "total $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The issue-size soak on one GPU (repo root, device machine; reference backend on CUDA, batch invariance
# on): 1,000 requests, prompts of 1-4,096 tokens, outputs of 1-64, DSpark, 20 requests checked alone.
# Structured requests join the mix where xgrammar imports on the machine (else study.structured=false, said so).
#   bash experiments/soak_gpu_run.sh [soak.py overrides...]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
structured=""
if ! python3 -c "import xgrammar" 2>/dev/null; then
  structured="study.structured=false"
  echo "xgrammar does not import here: greedy and sampled requests only" | tee "$out/structured.txt"
fi
timeout ${SOAK_TIMEOUT:-560} python3 experiments/soak.py study.check_alone=20 study.tag=tiny_4k $structured "$@" \
  engine.batch_invariant=true backend.device=cuda 2>&1 \
  | grep -v "it/s\]" | tail -60 | tee "$out/soak.log"
cp experiments/results/soak_cuda_tiny_4k.csv "$out/" 2>/dev/null

#!/usr/bin/env bash
# Engine-level GPU experiments in one command, run from the repo root on the device machine with
# the reference backend on CUDA (no TileLang needed): DSpark wall-clock speedup at batch 1/8/32
# (verify all drafts, then varlen) and the SWA bounded replay sweep with model=small up to 128k.
#   bash experiments/engine_h200_run.sh [all|dspark|replay] [max prompt length, default 131072]
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/card.txt"
what=${1:-all}
[ "$what" = replay ] || for varlen in false true; do
  timeout 150 python3 experiments/dspark_acceptance.py "study.batches=[1,8,32]" study.max_tokens=64 study.heldout=true study.tag="h200_varlen_$varlen" \
    backend.device=cuda decoding.varlen=$varlen 2>&1 | grep -v "it/s\]" | tail -6
  echo "dspark varlen=$varlen done at $(( $(date +%s) - start )) s"
done
lengths=1024,2048,4096,8192,16384,32768,65536,131072
lengths=$(echo $lengths | tr , '\n' | awk -v m="${2:-131072}" '$1 <= m' | paste -sd,)
[ "$what" = dspark ] || timeout $(( 580 - ($(date +%s) - start) )) python3 experiments/bounded_replay.py "study.lengths=[$lengths]" study.tag=h200 \
  model=small backend.device=cuda model.max_model_len=131200 engine.max_num_batched_tokens=4096 \
  engine.prefill_chunk_tokens=4096 2>&1 | tail -12
cp experiments/results/dspark_acceptance_h200* experiments/results/bounded_replay_h200* "$out/" 2>/dev/null
echo "total $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The engine on the sm100 backend, on the device machine in one command (repo root): TileLang
# unpacked from .carry/ (../shared/tools/pack_tilelang.sh), then a first generation on
# backend=sm100 (bf16 tiny_random, the reference on the GPU for the ops sm100 lacks), the
# op-level and end-to-end batch-invariance tests on sm100 (plain, DSpark, and the count with the
# mode off) and the decode cost of the mode on sm100. Logs go to $OUT.
#   bash experiments/sm100_engine_h200_run.sh [tests] [cost]   (default: both)
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
mkdir -p "$out"
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
sm100="backend.fallback=reference model.dtype=bfloat16"
timeout 240 python3 - <<'PY' 2>&1 | grep -v "it/s\]" | tail -20
import time
from deepinfer import LLM, SamplingParams
for invariant in ("false", "true"):
    t = time.time()
    llm = LLM("tiny_random", "sm100", ["engine.use_tqdm=false", "backend.fallback=reference", "model.dtype=bfloat16",
                                       f"engine.batch_invariant={invariant}"])
    outs = llm.generate([[5, 6, 7, 8], list(range(3, 40))], [SamplingParams(max_tokens=6, temperature=0)] * 2)
    print(f"batch_invariant={invariant}: {[o.token_ids for o in outs]} in {time.time() - t:.1f} s;",
          "on sm100:", sorted(op for op, src in llm.ops.sources.items() if src == "sm100"))
PY
echo "first generation done at $(( $(date +%s) - start )) s"
stages=${*:-tests cost}
if [[ $stages == *tests* ]]; then
  timeout $(( 480 - ($(date +%s) - start) )) python3 -m pytest -q -p no:cacheprovider --runslow -rA --tb=short \
    tests/backends/test_sm100_gpu_invariance.py tests/engine/test_batch_invariance.py -k "sm100 or gpu_invariance" \
    >"$out/invariance_sm100_pytest.log" 2>&1
  grep -v "it/s\]" "$out/invariance_sm100_pytest.log" | grep -E "^(E |FAILED|PASSED|[0-9]+ (passed|failed))|differ|Error" | head -40
  echo "tests done at $(( $(date +%s) - start )) s"
fi
if [[ $stages == *cost* ]]; then
  timeout $(( 580 - ($(date +%s) - start) )) python3 experiments/invariance_cost.py study.repeats=3 backend=sm100 \
    study.tag=sm100 $sm100 2>&1 | tail -6
  cp experiments/results/invariance_cost_cuda_sm100.csv "$out/" 2>/dev/null
fi
echo "total $(( $(date +%s) - start )) s"

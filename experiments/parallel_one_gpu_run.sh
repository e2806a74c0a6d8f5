#!/usr/bin/env bash
# Every parallel plan on one GPU through NCCL (repo root, device machine; carry .carry/whl): each plan launched
# with torchrun --nproc-per-node 1 and parallel.world_size=1, so that its process groups (expert, data, context)
# are joined with NCCL and every collective runs with one rank. model=tiny (MODEL=small: random weights, about
# a minute per launch to initialise), the reference backend on CUDA in batch-invariant mode; greedy and seeded sampling (experiments/parallel_launch_check.py), compared token
# for token with the plain one-process run (parallel=single). A check of the launch path and the outputs, not a speed or scaling run.
#   bash experiments/parallel_one_gpu_run.sh [extra overrides...]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
python3 - <<'PY' >"$out/prompts.txt"
print("def add(a, b):")
print("import os")
print("class Stack:")
print(" ".join(f"def scale_{i}(x): return x * {i} + {i * i}" for i in range(150)))  # about 3k tokens: split by cp2
PY
common=(model=${MODEL:-tiny} model.max_model_len=4096 backend.device=cuda engine.batch_invariant=true engine.max_num_seqs=4
        engine.num_kv_blocks=64 "$@")
run() {  # tag command...
  local tag=$1; shift
  local started=$(date +%s)
  "$@" >"$out/$tag.log" 2>&1
  echo "$tag rc=$? $(( $(date +%s) - started )) s" | tee -a "$out/runs.txt"
}
check=(experiments/parallel_launch_check.py "$out/prompts.txt")
run single python3 "${check[@]}" "$out/single.json" "${common[@]}" parallel=single
for plan in ep2 dp2 cp2 dp2_ep2; do
  extra=(); [ "$plan" = ep2 ] && extra=(parallel.num_extra_experts=2 parallel.eplb_interval=4)
  NCCL_DEBUG=VERSION run "$plan" python3 -m torch.distributed.run --standalone --nproc-per-node 1 "${check[@]}" \
    "$out/$plan.json" "${common[@]}" parallel=$plan parallel.world_size=1 "${extra[@]}"
done
grep -h "NCCL version" "$out"/*.log | head -1
python3 - "$out" <<'PY' | tee "$out/compare.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
want = json.loads((out / "single.json").read_text())
for plan in ("ep2", "dp2", "cp2", "dp2_ep2"):
    path = out / f"{plan}.json"
    if not path.exists():
        print(f"{plan:8} no output (see {plan}.log)")
        continue
    got = json.loads(path.read_text())
    for kind in ("greedy", "sampled"):
        equal = sum(g == w for g, w in zip(got[kind], want[kind]))
        print(f"{plan:8} {got['collectives']:5} {kind:8} {equal}/{len(want[kind])} requests equal to parallel=single "
              f"({sum(map(len, got[kind]))} tokens)")
PY

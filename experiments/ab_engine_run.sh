#!/usr/bin/env bash
# Two trees side by side on the device machine, from the repo root: experiments/bench_engine.py for sm100 alone
# (no fallback) on a baseline tree, then on this working tree, then the baseline again (so that drift of the
# machine during the call shows), each with the same arguments; CSVs and logs go to $OUT as ab_base_*, ab_new_*.
# BASE is a directory holding an earlier commit's files, carried with .carry/:
#   git archive <commit> | (mkdir -p .carry/base && tar -x -C .carry/base)
#   BASE=.carry/base bash experiments/ab_engine_run.sh [bench arguments...]
set -u
export TILELANG_CACHE_DIR=/tmp/tlcache
out=${OUT:-/tmp/out}
base=$(cd "${BASE:?set BASE to the baseline tree}" && pwd)
mkdir -p "$out" /tmp/shimb/deepinfer-0.1.0.dist-info
start=$(date +%s)
TILELANG=1 source experiments/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/card.txt"
ln -sfn "$base/backends" /tmp/shimb/deepinfer_backends
cp /tmp/shim/deepinfer-0.1.0.dist-info/METADATA /tmp/shimb/deepinfer-0.1.0.dist-info/
sed -n '/^\[project.entry-points."deepinfer.backends"\]/,/^$/p' "$base/pyproject.toml" \
  | sed 's/^\[project.entry-points."deepinfer.backends"\]/[deepinfer.backends]/; s/"//g' \
  >/tmp/shimb/deepinfer-0.1.0.dist-info/entry_points.txt
bench() {  # tree tag pythonpath
  (cd "$1" && PYTHONPATH="$3" timeout ${AB_TIMEOUT:-180} python3 experiments/bench_engine.py study.tag="ab_$2" \
    study.reference=false "${@:4}" model.dtype=bfloat16 2>&1 | grep -v "it/s\]\|TileLang\|_warn_once\|acc_events" \
    | tee "$out/ab_$2.log" | grep -E "^engine|kernels|wrote" ; cp experiments/results/bench_engine_ab_$2.csv "$out/" 2>/dev/null)
  echo "$2 done at $(( $(date +%s) - start )) s"
}
bench "$base" base /tmp/site:/tmp/shimb:$base "$@"
bench "$PWD" new "$PYTHONPATH" "$@"
bench "$base" base_again /tmp/site:/tmp/shimb:$base "$@"
echo "total $(( $(date +%s) - start )) s"

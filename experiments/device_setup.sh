# Sourced by the GPU run scripts, from the repo root on the device machine (no package registry):
# installs the carried wheels (.carry/whl: hydra-core, omegaconf, antlr) into /tmp/site and makes
# the working tree importable as deepinfer + deepinfer_backends with its backend entry points.
# With TILELANG=1 it also unpacks .carry/tilelang-cp312.tar.xz (../shared/tools/pack_tilelang.sh).
# It unpacks .carry/tlcache.tar.xz into $TILELANG_CACHE_DIR when both are there, and sets
# DEEPINFER_SM100_COMPILE_LOG to $OUT/sm100_kernels.jsonl when $OUT is set (experiments/README.md).
mkdir -p /tmp/site /tmp/shim/deepinfer-0.1.0.dist-info
if [ "${TILELANG:-0}" = 1 ]; then tar -xJf .carry/tilelang-cp312.tar.xz -C /tmp/site || exit 1; fi
# Kernels compiled ahead on the CPU machine (experiments/prewarm_kernels.py study.pack=.carry/tlcache.tar.xz), and a
# log of the ones this run compiles, which comes back in $OUT for the next prewarm.
if [ -f .carry/tlcache.tar.xz ] && [ -n "${TILELANG_CACHE_DIR:-}" ]; then
  mkdir -p "$TILELANG_CACHE_DIR" && tar -xJf .carry/tlcache.tar.xz -C "$TILELANG_CACHE_DIR"
fi
if [ -n "${OUT:-}" ]; then export DEEPINFER_SM100_COMPILE_LOG="${DEEPINFER_SM100_COMPILE_LOG:-$OUT/sm100_kernels.jsonl}"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl || exit 1
ln -sfn "$PWD/backends" /tmp/shim/deepinfer_backends
printf 'Metadata-Version: 2.1\nName: deepinfer\nVersion: 0.1.0\n' >/tmp/shim/deepinfer-0.1.0.dist-info/METADATA
sed -n '/^\[project.entry-points."deepinfer.backends"\]/,/^$/p' pyproject.toml \
  | sed 's/^\[project.entry-points."deepinfer.backends"\]/[deepinfer.backends]/; s/"//g' \
  >/tmp/shim/deepinfer-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:/tmp/shim:$PWD PYTHONUNBUFFERED=1

set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"; start=$(date +%s)
export TILELANG_CACHE_DIR=/tmp/tlcache
TILELANG=1 source experiments/device_setup.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/hal/test_parity.py -k "sm100 and indexer" -rA 2>&1 | tail -8 | tee "$out/indexer_parity.log"
timeout 200 python3 -m deepinfer_backends.sm100.kernels.indexer_logits 2>&1 | tail -3 | tee "$out/indexer_bench.log"
timeout 100 python3 -c "
from deepinfer_backends.sm100.kernels.indexer_logits import main
main(tokens=1, keys=65536); main(tokens=64, keys=65536)" 2>&1 | tail -3 | tee -a "$out/indexer_bench.log"
echo "total $(( $(date +%s) - start )) s"

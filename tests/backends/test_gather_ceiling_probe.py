"""``experiments/gather_ceiling.py`` reads the rows it claims to read: its Triton kernel, run by
Triton's CPU interpreter (skipped without triton), against a sum over ``cache[keys]`` in torch."""
import importlib.util
import os
import subprocess
import sys

import pytest

from deepinfer.study import REPO_ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the probe needs triton")
CHECK = r"""
import torch
from deepinfer.study import load_script
probe = load_script("gather_ceiling")
g = torch.Generator().manual_seed(0)
for row_bytes, rows, keys_shape in ((288, 50, (3, 1, 7)), (528, 9, (2, 1, 5)), (1024, 4000, (2100,))):
    cache = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
    keys = torch.randint(0, rows, keys_shape, dtype=torch.int32, generator=g)
    call, sums = probe.read_rows(cache, keys)
    call()
    units = cache.view(torch.int32)[keys.reshape(-1).long()].reshape(-1, 4).long().sum(1)
    want = torch.zeros(sums.numel(), dtype=torch.long).index_add_(
        0, torch.arange(units.numel()) // probe.BLOCK, units)
    want = ((want + 2 ** 31) % 2 ** 32 - 2 ** 31).int()  # int32 wrap-around
    assert torch.equal(sums, want), (row_bytes, sums[:4], want[:4])
print("ok")
"""


def test_the_probe_kernel_sums_exactly_the_gathered_rows():
    """Row sizes of fp4, fp8 and bf16 keys; the last spans 66 programs (2100 rows of 64 units)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO_ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

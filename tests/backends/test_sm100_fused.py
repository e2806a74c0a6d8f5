"""The sm100 Triton kernels against the reference on every case of their op, run by Triton's
interpreter on the CPU (a subprocess: the interpreter is chosen when triton is imported). The
parity grid runs them on a GPU (``tests/hal/test_parity.py``)."""
import importlib.util
import os
import subprocess
import sys

import pytest

OPS = ("mhc_mixes", "mhc_head", "mhc_pre", "mhc_post", "apply_rope", "ep_combine", "kv_load", "swiglu")

CHECK = """
import sys
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100 import wrappers

for op in sys.argv[1:]:
    spec = SPECS[op]
    for case in spec.cases:
        inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
        got = getattr(wrappers, op)(**inputs)
        failures = compare(got, spec.reference(**inputs), spec.tolerance(case.dtype or torch.float32), case.name)
        assert not failures, failures
        print(op, case.name, "ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_reference_in_the_interpreter():
    from deepinfer.hal.spec import SPECS
    import deepinfer.hal.ops  # noqa: F401

    done = subprocess.run([sys.executable, "-c", CHECK, *OPS], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [f"{op} {case.name} ok" for op in OPS for case in SPECS[op].cases]
    assert done.stdout.splitlines() == expected


CAST = """
import torch
from deepinfer.hal.formats import cast_back
from deepinfer_backends.sm100.fused.mxfp4_cast import BLOCK_ROWS, mxfp4_cast_kernel

gen = torch.Generator().manual_seed(0)
tokens, heads, dim, heads_pad = 5, 3, 128, 4
q = torch.randn(tokens, heads, dim, generator=gen) * torch.exp2(torch.randint(-20, 20, (tokens, heads, 1), generator=gen))
grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.5, 3.0, 3.5, 5.0, 6.0, -0.25, -0.0, -6.0])
q[0, 0] = grid.repeat(8) * 4.0  # the rounding thresholds and ties, exactly, in blocks scaled by powers of two
q[0, 1] = 0.0  # zero blocks
q[1, 2, :32] = 6.0 * 2.0 ** -126  # a block whose scale is the smallest normal one
q = q.to(torch.bfloat16)
out = torch.full((tokens, heads_pad, dim), 7.0, dtype=torch.bfloat16)
mxfp4_cast_kernel[(-(-tokens * heads // BLOCK_ROWS),)](q, out, tokens * heads, heads, heads_pad, dim, DIM=dim,
                                                        BLOCK_ROWS=BLOCK_ROWS)
want = cast_back(q.float(), "mxfp4", 32).to(torch.bfloat16)
assert torch.equal(out[:, :heads].view(torch.int16), want.view(torch.int16)), (out[:, :heads] - want).abs().max()
assert torch.equal(out[:, heads:], torch.full_like(out[:, heads:], 7.0)), "rows past the heads are left alone"
print("mxfp4 cast ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mxfp4_cast_kernel_gives_the_reference_bits_in_the_interpreter():
    done = subprocess.run([sys.executable, "-c", CAST], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "mxfp4 cast ok"

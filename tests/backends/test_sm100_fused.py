"""The sm100 Triton kernels against the reference on every case of their op, run by Triton's
interpreter on the CPU (a subprocess: the interpreter is chosen when triton is imported). The
parity grid runs them on a GPU (``tests/hal/test_parity.py``)."""
import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = """
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.ops.mhc import mhc_mixes, normalized_mixes
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100.fused.mhc_mixes import BLOCK_TOKENS, mhc_mixes_kernel

spec = SPECS["mhc_mixes"]
for case in spec.cases:
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    residual = inputs["residual"]
    tokens, hc, _ = residual.shape
    mixes = normalized_mixes(residual, inputs["fn"], inputs["norm_eps"])
    pre, post, comb = torch.empty(tokens, hc), torch.empty(tokens, hc), torch.empty(tokens, hc, hc)
    mhc_mixes_kernel[(-(-tokens // BLOCK_TOKENS),)](
        mixes, inputs["scale"].float(), inputs["base"].float(), pre, post, comb, tokens, mixes.stride(0),
        float(inputs["hc_eps"]), HC=hc, ITERS=int(inputs["sinkhorn_iters"]), BLOCK=BLOCK_TOKENS)
    failures = compare((pre, post, comb), mhc_mixes(**inputs), spec.tolerance(torch.float32), case.name)
    assert not failures, failures
    print(case.name, "ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mhc_mixes_kernel_matches_the_reference_in_the_interpreter():
    from deepinfer.hal.spec import SPECS
    import deepinfer.hal.ops  # noqa: F401

    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [w for case in SPECS["mhc_mixes"].cases for w in (case.name, "ok")]

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

"""RMSNorm with a residual as DeepInfer 0.1.0 computes it (issue 29): the sum ``x + residual`` is
rounded to the residual's dtype (the new residual stream) and the norm is taken of that rounded
sum, not of the float32 sum."""
import pytest
import torch

from deepinfer.hal import OpTable

WIDTH = 16  # 64 bytes of float32: ascend950 moves rows in 32-byte blocks


def _row() -> torch.Tensor:
    x = torch.ones(1, WIDTH, dtype=torch.float64)
    x[0, 0] = 1 + 2**-10
    return x


@pytest.mark.parametrize("backend", ["reference", "ascend950"])
def test_the_norm_reads_the_rounded_sum(backend):
    # x = [1 + 2^-10, 1, ..., 1] (float32) plus a zero bf16 residual: the bf16 sum is all ones (2^-10 is
    # below half of bf16's step 2^-7 at 1), whose RMS is 1, so the normalised row is the weight itself.
    weight = torch.arange(1.0, WIDTH + 1)
    table = OpTable(backend, options={"execution": "emulate"} if backend == "ascend950" else None)
    normed, summed = table.rms_norm(_row().float(), weight, 0.0, residual=torch.zeros(1, WIDTH, dtype=torch.bfloat16))
    assert summed.dtype == torch.bfloat16 and torch.equal(summed.float(), torch.ones(1, WIDTH))
    assert torch.equal(normed, weight[None])


def test_a_float32_residual_keeps_the_float32_sum():
    # the same row with a float32 residual: the sum keeps 1 + 2^-10, and the norm divides by its RMS
    x = _row()
    rms = ((x[0, 0] ** 2 + WIDTH - 1) / WIDTH).sqrt()
    normed, summed = OpTable("reference").rms_norm(x.float(), torch.ones(WIDTH), 0.0, residual=torch.zeros(1, WIDTH))
    assert torch.equal(summed.double(), x)
    torch.testing.assert_close(normed.double(), x / rms, atol=1e-7, rtol=0)

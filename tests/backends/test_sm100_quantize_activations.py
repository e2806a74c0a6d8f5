"""The sm100 ``quantize_activations`` Triton kernel writes the reference's bytes: every OpSpec case
but the real-size ones, block maxima on both sides of the scale rule's boundary (``1.75 * 2^E``)
over many binades, and random rows over 150 binades, run by Triton's interpreter on the CPU (a
subprocess: the interpreter is chosen when triton is imported). The GPU runs the same through the
kernel module's ``main()`` and the parity grid."""
import importlib.util

import pytest

from tests.backends.test_sm100_fused import interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = """
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.formats import quantize
from deepinfer.hal.spec import SPECS
from deepinfer_backends.sm100.quantize_activations import quantize_activations


def same_bytes(x, label, row_scale=None):
    got = quantize_activations(x, row_scale=row_scale)
    want = quantize(x if row_scale is None else x.float() * row_scale[..., None], "fp8", 32)
    codes = got.data.view(torch.uint8) != want.data.view(torch.uint8)
    assert not codes.any(), (label, x[codes][:4].tolist(), got.data[codes][:4].view(torch.uint8).tolist(),
                             want.data[codes][:4].view(torch.uint8).tolist())
    assert torch.equal(got.scale, want.scale), (label, (got.scale != want.scale).nonzero()[:4].tolist())
    assert got.data.shape == x.shape and got.scale.shape == (*x.shape[:-1], x.shape[-1] // 32), label
    print(label, "ok")


spec = SPECS["quantize_activations"]
for case in (c for c in spec.cases if c.size != "real"):
    same_bytes(label=case.name, **case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu")))

# block maxima within 2048 ulps of 1.75 * 2^E and of 2^E, over binades from the floor's to 2^100
mantissas = torch.cat((torch.arange(0x600000 - 2048, 0x600000 + 2048), torch.arange(0, 2048),
                       torch.arange(0x800000 - 2048, 0x800000)))
maxima = torch.cat([((e + 127) << 23 | mantissas).to(torch.int32).view(torch.float32) for e in (-13, -1, 0, 7, 100)])
gen = torch.Generator().manual_seed(1)
rows = torch.rand(maxima.shape[0], 32, generator=gen) * 2 - 1
rows = rows * maxima[:, None]
rows[:, 0] = maxima * torch.where(torch.arange(maxima.shape[0]) % 2 == 0, 1.0, -1.0)
same_bytes(rows.reshape(-1, 256), "maxima at the scale boundaries")

# normal rows whose blocks span 2^-75 to 2^75
x = torch.randn(64, 1024, generator=gen)
x = x * torch.exp2(torch.randint(-75, 76, (64, 32), generator=gen).float()).repeat_interleave(32, -1)
same_bytes(x, "150 binades")
same_bytes(x.bfloat16(), "150 binades, bf16")
same_bytes(x[:, 96:608], "a strided view")
same_bytes(x.bfloat16(), "150 binades, bf16, router weights", torch.rand(64, generator=gen))
"""


def test_the_kernel_writes_the_references_codes_and_scales_in_the_interpreter():
    from deepinfer.hal.spec import SPECS
    import deepinfer.hal.ops  # noqa: F401

    cases = [case.name for case in SPECS["quantize_activations"].cases if case.size != "real"]
    extra = ["maxima at the scale boundaries", "150 binades", "150 binades, bf16", "a strided view",
             "150 binades, bf16, router weights"]
    assert interpreted(CHECK).splitlines() == [f"{name} ok" for name in cases + extra]

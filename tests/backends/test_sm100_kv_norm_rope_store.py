"""The sm100 ``kv_norm_rope_store`` kernel's encode math, emulated in PyTorch step by step as the
kernel computes it (floored block max, UE8M0 scale from the bits of the quotient, e4m3 scale
times its reciprocal, e2m1 thresholds and sign bit, decode by arithmetic), against
``deepinfer.hal.formats`` on values chosen to sit on every rounding edge. Runs on a CPU;
the kernel itself is checked on the GPU by ``python -m deepinfer_backends.sm100.kernels.kv_norm_rope_store``."""
import pytest
import torch

from deepinfer.hal import formats
from deepinfer.hal.formats import decode_tokens, encode_tokens, token_format, ue8m0_scale

LAYOUT = {"fp8": (32, "ue8m0", "e4m3"), "fp4": (16, "e4m3", "e2m1"), "index_fp4": (32, "ue8m0", "e2m1")}
"""Per format: values per scale, scale kind, element kind (the kernel module's ``FORMATS``)."""
ELEMENT_MAX = {"e4m3": 448.0, "e2m1": 6.0}
AMAX_FLOOR = {"fp8": formats.FP8_AMAX_FLOOR, "index_fp4": formats.MXFP4_AMAX_FLOOR, "fp4": formats.NVFP4_AMAX_FLOOR}
"""The kernel module's ``AMAX_FLOOR``: the block max floors of ``deepinfer.hal.formats``."""


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    return ((exponent + 127) << 23).int().view(torch.float32)


def ue8m0_exponent(amax: torch.Tensor, fmt_max: float, floor: float) -> torch.Tensor:
    """The kernel's ``((bits - 1) >> 23) + 1 - 127`` of the floored quotient."""
    bits = (torch.maximum(amax, torch.tensor(floor)) / torch.tensor(fmt_max)).view(torch.int32)
    return ((bits - 1) >> 23) + 1 - 127


def e2m1_code(value: torch.Tensor) -> torch.Tensor:
    a = value.abs()
    magnitude = sum((a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0), torch.zeros_like(a)).int()
    return magnitude | torch.where(value.view(torch.int32) < 0, 8, 0)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    magnitude = code & 7
    value = torch.where(magnitude < 2, magnitude.float() * 0.5,
                        (1.0 + 0.5 * (magnitude & 1).float()) * pow2((magnitude >> 1) - 1))
    return torch.where((code & 8) > 0, -value, value)


def kernel_encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's cache rows and decoded copy of float32 ``x [n, dim]``, step by step."""
    block, scale_kind, element = LAYOUT[fmt]
    blocks = x.reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1)
    if scale_kind == "ue8m0":
        exponent = ue8m0_exponent(amax, ELEMENT_MAX[element], AMAX_FLOOR[fmt])
        scale, scale_bytes = pow2(exponent), (exponent + 127).to(torch.uint8)
        scaled = blocks * pow2(-exponent).unsqueeze(-1)
    else:
        product = torch.maximum(amax, torch.tensor(AMAX_FLOOR[fmt])) * torch.tensor(1.0 / 6.0)
        scale = torch.minimum(product, torch.tensor(448.0)).to(torch.float8_e4m3fn).float()
        scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
        scaled = blocks * (torch.ones_like(scale) / scale).unsqueeze(-1)
    if element == "e4m3":
        codes = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        decoded, data = codes.float() * scale.unsqueeze(-1), codes.view(torch.uint8).reshape(x.shape[0], -1)
    else:
        codes = e2m1_code(scaled)
        decoded = e2m1_value(codes) * scale.unsqueeze(-1)
        flat = codes.reshape(x.shape[0], -1).to(torch.uint8)
        data = flat[:, 0::2] | (flat[:, 1::2] << 4)
    return torch.cat((data, scale_bytes), dim=1), decoded.reshape(x.shape)


def _edge_rows(fmt: str) -> torch.Tensor:
    """Blocks whose max fixes an exact scale and whose other values sit on, and one float32 ulp
    either side of, every e2m1 threshold or e4m3 midpoint, and +-0; zero blocks, negative and tiny or
    huge blocks, block maxes a few ulps around the powers of two that border a UE8M0 scale, and
    random rows."""
    block, scale_kind, element = LAYOUT[fmt]
    dim = token_format(fmt).dim
    fmt_max = ELEMENT_MAX[element]
    if element == "e2m1":
        edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0, 0.1, 0.0])
    else:
        edges = torch.tensor([1.0625, 1.125, 1.1875, 3.0 * 2 ** -9, 2 ** -10, 2 ** -7, 300.0, 440.0, 448.0, 0.0])
    edges = torch.cat((edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(9e9))))
    values = torch.cat((edges, -edges))
    scales = torch.exp2(torch.arange(-60, 61, 7, dtype=torch.float32))
    if scale_kind == "e4m3":
        scales = torch.cat((scales, torch.tensor([0.625, 1.375, 0.01171875, 3.0 * 2 ** -9, 2 ** -8])))
    per_block = block - 1
    rows = []
    for s in scales.tolist():
        body = values.repeat(-(-per_block * (dim // block) // values.numel()))[: per_block * (dim // block)]
        blocks = torch.cat((torch.full((dim // block, 1), fmt_max), body.reshape(dim // block, per_block)), dim=1)
        rows.append((blocks * s).reshape(dim))
    base = torch.tensor(fmt_max) * torch.exp2(torch.arange(-140, 128, 3, dtype=torch.float32))
    bits = base.view(torch.int32).unsqueeze(1) + torch.arange(-4, 5, dtype=torch.int32)
    maxes = bits.flatten().view(torch.float32)
    maxes = maxes[torch.isfinite(maxes) & (maxes > 0)]
    maxes = torch.cat((maxes, torch.tensor([1e-45, 1e-40, 3e38, 2 ** -127 * fmt_max])))
    for chunk in maxes.split(dim // block):
        blocks = torch.zeros(dim // block, block)
        blocks[: chunk.numel(), 0] = chunk
        blocks[: chunk.numel(), 1] = -chunk * 0.3
        rows.append(blocks.reshape(dim))
    rows.append(torch.zeros(dim))
    gen = torch.Generator().manual_seed(0)
    rows.append(torch.randn(64, dim, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=gen)))
    return torch.cat([r.reshape(-1, dim) for r in rows])


@pytest.mark.parametrize("fmt", sorted(LAYOUT))
def test_kernel_encode_math_matches_the_formats_bitwise(fmt):
    x = _edge_rows(fmt)
    stored, decoded = kernel_encode(x, fmt)
    want = encode_tokens(x, fmt)
    bad = (stored != want).any(1)
    assert not bad.any(), f"{fmt}: {bad.sum().item()} rows differ, first {x[bad][0][:8].tolist()}"
    assert torch.equal(decoded, decode_tokens(want, fmt))


@pytest.mark.parametrize("fmt", ["fp8", "index_fp4"])
def test_ue8m0_exponent_from_bits_is_the_least_power_of_two_at_or_above_the_quotient(fmt):
    """Block maxes a few ulps either side of every power of two times the element max, and below
    the floor: the kernel's bit formula gives the least ``e`` with ``2^e`` at or above the float32
    quotient (from its binary mantissa, exactly 1/2 for a power of two) and ``formats``' byte."""
    fmt_max = ELEMENT_MAX[LAYOUT[fmt][2]]
    powers = torch.exp2(torch.arange(-149, 128, dtype=torch.float32)) * fmt_max
    bits = powers.view(torch.int32).unsqueeze(1) + torch.arange(-3, 64, dtype=torch.int32)
    amax = bits.flatten().view(torch.float32)
    amax = torch.cat((amax[torch.isfinite(amax) & (amax > 0)], torch.zeros(1)))
    got = ue8m0_exponent(amax, fmt_max, AMAX_FLOOR[fmt])
    quotient = (torch.maximum(amax, torch.tensor(AMAX_FLOOR[fmt])) / fmt_max).double()
    mantissa, exponent = torch.frexp(quotient)
    assert torch.equal(got.long(), torch.where(mantissa == 0.5, exponent - 1, exponent).long())
    assert torch.equal((got + 127).to(torch.uint8), ue8m0_scale(amax, fmt_max, AMAX_FLOOR[fmt]))


def test_the_wrapper_names_the_kernel_formats_and_floors():
    pytest.importorskip("tilelang")  # the kernel module imports it
    from deepinfer_backends.sm100.kernels.kv_norm_rope_store import AMAX_FLOOR as KERNEL_FLOOR
    from deepinfer_backends.sm100.kernels.kv_norm_rope_store import FORMATS
    from deepinfer_backends.sm100.wrappers import KV_STORE_FORMATS

    assert set(KV_STORE_FORMATS) == set(FORMATS)
    assert {fmt: token_format(fmt).dim for fmt in FORMATS} == {fmt: spec[0] for fmt, spec in FORMATS.items()}
    assert {fmt: spec[1:] for fmt, spec in FORMATS.items() if fmt in LAYOUT} == LAYOUT
    assert KERNEL_FLOOR == AMAX_FLOOR

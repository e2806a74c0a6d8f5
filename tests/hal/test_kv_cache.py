"""kv_store / kv_load against an independent float64 codec written from the format definitions.

The codec below builds value tables from the bit layouts (e4m3, e2m1, bf16) and encodes by
nearest-table-entry search (ties to the even code), not by the arithmetic in formats.py. Scales
follow DeepInfer's rules: block maxima floored (fp8 1e-4, index_fp4 6 * 2^-126, fp4 6 * 2^-9),
UE8M0 the least power of two at or above the float32 quotient, the fp4 e4m3 scale from
``max * float32(1/6)`` and values multiplied by its float32 reciprocal. Each float32 step is the
exact float64 result rounded once to float32 (exact products; for quotients float64 leaves room
enough that rounding twice equals rounding once)."""
import pytest
import torch

from deepinfer.hal import formats
from deepinfer.hal.ops.kv_cache import kv_load, kv_store
from deepinfer.hal.spec import SPECS
from tests.hal.oracle import check_against_oracle

F64 = torch.float64


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


E4M3 = torch.tensor([e4m3_value(c) for c in range(256)], dtype=F64)
E2M1 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=F64)


def nearest_code(magnitude, table):
    """Index of the nearest entry of an ascending table (saturating), ties to the even index."""
    a = magnitude.clamp(max=table[-1].item())
    hi = torch.searchsorted(table, a.contiguous()).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def encode_e4m3(v):
    return nearest_code(v.abs(), E4M3[:127]) | (torch.signbit(v).long() << 7)


def encode_e2m1(v):
    """Nearest e2m1 code, its sign bit ``v``'s (a negative value rounding to zero keeps it)."""
    return nearest_code(v.abs(), E2M1[:8]) | (torch.signbit(v).long() << 3)


def f32(v):
    """``v`` rounded once to float32, back in float64."""
    return v.float().double()


FP8_FLOOR, INDEX_FP4_FLOOR, FP4_FLOOR = f32(torch.tensor(1e-4, dtype=F64)), 6.0 * 2.0 ** -126, 6.0 * 2.0 ** -9


def ue8m0_exponent(amax, fmt_max, floor):
    """Least ``e`` with ``2^e >= float32(max(amax, floor) / fmt_max)``, from the quotient's binary
    mantissa (exactly 1/2 for a power of two)."""
    mantissa, exponent = torch.frexp(f32(amax.clamp(min=floor) / fmt_max))
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(F64)


def pack(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed):
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def encode_rows(x, fmt):
    """float64 [n, dim] -> uint8 [n, bytes] from the format definitions."""
    n = x.shape[0]
    if fmt in ("bf16", "index_bf16"):
        bits = x.float().view(torch.int32).long() & 0xFFFFFFFF
        half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return torch.stack((half & 0xFF, (half >> 8) & 0xFF), dim=-1).reshape(n, -1).to(torch.uint8)
    if fmt == "fp8":
        blocks = x.reshape(n, -1, 32)
        exponent = ue8m0_exponent(blocks.abs().amax(-1), 448.0, FP8_FLOOR)
        data = encode_e4m3(blocks / torch.exp2(exponent).unsqueeze(-1)).reshape(n, -1)
        scale = exponent.long() + 127
    elif fmt == "fp4":
        blocks = x.reshape(n, -1, 16)
        scale = encode_e4m3(f32(blocks.abs().amax(-1).clamp(min=FP4_FLOOR) * f32(torch.tensor(1 / 6, dtype=F64))))
        reciprocal = f32(1.0 / E4M3[scale])
        data = pack(encode_e2m1(f32(blocks * reciprocal.unsqueeze(-1))).reshape(n, -1))
    else:
        blocks = x.reshape(n, -1, 32)
        exponent = ue8m0_exponent(blocks.abs().amax(-1), 6.0, INDEX_FP4_FLOOR)
        data = pack(encode_e2m1(blocks / torch.exp2(exponent).unsqueeze(-1)).reshape(n, -1))
        scale = exponent.long() + 127
    return torch.cat((data, scale), dim=-1).to(torch.uint8)


def decode_rows(rows, fmt):
    """uint8 [n, bytes] -> float64 [n, dim] from the format definitions."""
    rows = rows.long()
    n = rows.shape[0]
    if fmt in ("bf16", "index_bf16"):
        half = rows[:, 0::2] | (rows[:, 1::2] << 8)
        sign = torch.where(half >= 0x8000, -1.0, 1.0).to(F64)
        exponent, mantissa = (half >> 7) & 0xFF, (half & 0x7F).to(F64)
        normal = (1 + mantissa / 128) * torch.exp2(exponent.to(F64) - 127)
        return sign * torch.where(exponent == 0, mantissa / 128 * 2.0 ** -126, normal)
    if fmt == "fp8":
        values, scales = E4M3[rows[:, :512]], torch.exp2(rows[:, 512:].to(F64) - 127)
    elif fmt == "fp4":
        values, scales = E2M1[unpack(rows[:, :256])], E4M3[rows[:, 256:]]
    else:
        values, scales = E2M1[unpack(rows[:, :64])], torch.exp2(rows[:, 64:].to(F64) - 127)
    block = values.shape[1] // scales.shape[1]
    return (values.reshape(n, -1, block) * scales.unsqueeze(-1)).reshape(n, -1)


def kv_store_float64(cache, slots, x, fmt):
    flat, encoded = cache.view(-1, cache.shape[-1]), encode_rows(x, fmt)
    for i, slot in enumerate(slots.tolist()):
        if slot != -1:
            flat[slot] = encoded[i]
    return cache


def kv_load_float64(cache, slots, fmt, dtype=torch.float32):  # noqa: ARG001 (the values are exact in any dtype)
    decoded = decode_rows(cache.view(-1, cache.shape[-1]), fmt)
    dim = formats.token_format(fmt).dim
    return torch.stack([decoded[s] if s != -1 else torch.zeros(dim, dtype=F64) for s in slots.tolist()])


def kv_cast_float64(x, fmt):
    return decode_rows(encode_rows(x, fmt), fmt)


@pytest.mark.parametrize("case", [c.name for c in SPECS["kv_cast"].cases])
def test_kv_cast_matches_float64(case):
    check_against_oracle("kv_cast", case, kv_cast_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["kv_store"].cases])
def test_kv_store_matches_float64(case):
    check_against_oracle("kv_store", case, kv_store_float64)


@pytest.mark.parametrize("case", [c.name for c in SPECS["kv_load"].cases])
def test_kv_load_matches_float64(case):
    check_against_oracle("kv_load", case, kv_load_float64)


@pytest.mark.parametrize("fmt", sorted(formats.TOKEN_FORMATS))
def test_bf16_load_holds_the_float32_values_exactly(fmt):
    spec = formats.token_format(fmt)
    x = torch.randn(9, spec.dim, generator=torch.Generator().manual_seed(2)) * 5
    cache = torch.zeros(3, 4, spec.bytes_per_token, dtype=torch.uint8)
    slots = torch.tensor([5, 0, -1, 7, 2, 3, 11, 1, 4])
    kv_store(cache, slots, x, fmt)
    wide, narrow = kv_load(cache, slots, fmt), kv_load(cache, slots.int(), fmt, dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), wide)


def test_kv_load_refuses_other_dtypes_and_float_slots():
    cache = torch.zeros(2, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match="decodes to one of"):
        kv_load(cache, torch.tensor([0]), "index_fp4", dtype=torch.float16)
    with pytest.raises(ValueError, match="slots must be int64 or int32"):
        kv_load(cache, torch.tensor([0.0]), "index_fp4")


@pytest.mark.parametrize("fmt", sorted(formats.TOKEN_FORMATS))
def test_round_trip_equals_cast_back(fmt):
    spec = formats.token_format(fmt)
    x = torch.randn(6, spec.dim, generator=torch.Generator().manual_seed(1)) * 3
    cache = torch.zeros(2, 4, spec.bytes_per_token, dtype=torch.uint8)
    slots = torch.tensor([5, 0, -1, 7, 2, 3])
    loaded = kv_load(kv_store(cache, slots, x, fmt), slots, fmt)
    inner = {"fp8": ("fp8", 32), "fp4": ("nvfp4", 16), "index_fp4": ("mxfp4", 32)}.get(fmt)
    want = formats.cast_back(x, *inner) if inner else x.to(torch.bfloat16).float()
    want[2] = 0.0
    assert torch.equal(loaded, want)


@pytest.mark.parametrize("fmt,nbytes", [("fp8", 528), ("fp4", 288), ("index_fp4", 68), ("bf16", 1024)])
def test_byte_counts_and_neighbouring_rows_untouched(fmt, nbytes):
    dim = formats.token_format(fmt).dim
    cache = torch.full((3, nbytes), 0xAB, dtype=torch.uint8)
    kv_store(cache, torch.tensor([1]), torch.randn(1, dim), fmt)
    assert (cache[0] == 0xAB).all() and (cache[2] == 0xAB).all() and not (cache[1] == 0xAB).all()
    with pytest.raises(ValueError, match=f"uint8 \\[..., {nbytes}\\]"):
        kv_store(torch.zeros(3, nbytes - 1, dtype=torch.uint8), torch.tensor([1]), torch.randn(1, dim), fmt)


def test_hand_worked_fp8_token():
    x = torch.zeros(1, 512)
    x[0, :32] = 1.0                                  # amax 1: scale 2^-8 (byte 119), 256 = 0x78
    x[0, 32:36] = torch.tensor([896.0, -448.0, 3.0, 0.0])  # amax 896: scale 2 (byte 128)
    x[0, 64] = 0.1                                   # scale 2^-12 (byte 115); 409.6 -> 416 = 0x7D
    row = kv_store(torch.zeros(1, 528, dtype=torch.uint8), torch.tensor([0]), x, "fp8")[0]
    assert row[:32].tolist() == [0x78] * 32
    assert row[32:36].tolist() == [0x7E, 0xF6, 0x3C, 0x00]  # 448, -224, 1.5, 0
    assert row[64].item() == 0x7D
    assert row[512:].tolist() == [119, 128, 115] + [105] * 13  # zero blocks: max floored to 1e-4, scale 2^-22
    assert (row[36:64] == 0).all() and (row[65:512] == 0).all()
    loaded = kv_load(row[None], torch.tensor([0]), "fp8")[0]
    assert loaded[32:36].tolist() == [896.0, -448.0, 3.0, 0.0] and loaded[64].item() == 416 / 4096


def test_hand_worked_fp4_tokens():
    x = torch.zeros(1, 512)
    x[0, :5] = torch.tensor([6.0, -0.5, 1.0, 0.0, 3.0])  # amax 6: e4m3 scale 1.0 = 0x38
    x[0, 16:18] = torch.tensor([12.0, 1.0])              # amax 12: scale 2.0 = 0x40; codes 6, 0.5
    row = kv_store(torch.zeros(1, 288, dtype=torch.uint8), torch.tensor([0]), x, "fp4")[0]
    assert row[:3].tolist() == [0x97, 0x02, 0x05] and row[8].item() == 0x17
    assert row[256:].tolist() == [0x38, 0x40] + [0x01] * 30  # zero blocks: max floored to 6 * 2^-9, scale 2^-9
    x = torch.zeros(1, 128)
    x[0, :5] = torch.tensor([6.0, -0.5, 1.0, 0.0, 3.0])  # amax 6: UE8M0 scale 1 (byte 127)
    x[0, 32:34] = torch.tensor([12.0, 1.0])              # amax 12: scale 2 (byte 128)
    row = kv_store(torch.zeros(1, 68, dtype=torch.uint8), torch.tensor([0]), x, "index_fp4")[0]
    assert row[:3].tolist() == [0x97, 0x02, 0x05] and row[16].item() == 0x17
    assert row[64:].tolist() == [127, 128, 1, 1]  # zero blocks: max floored to 6 * 2^-126, scale 2^-126


def test_hand_worked_ties_round_to_even():
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -6.0])
    x = torch.zeros(1, 512)
    x[0, :10] = ties                                 # FP4 scale 1.0; codes 7 0 2 2 4 4 6 6, -0.25 -> -0 (0x8)
    row = kv_store(torch.zeros(1, 288, dtype=torch.uint8), torch.tensor([0]), x, "fp4")[0]
    assert row[:5].tolist() == [0x07, 0x22, 0x44, 0x66, 0xF8]
    x[0, :4] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625])  # FP8 scale 1: ties between e4m3 steps
    row = kv_store(torch.zeros(1, 528, dtype=torch.uint8), torch.tensor([0]), x, "fp8")[0]
    assert row[:4].tolist() == [0x7E, 0x38, 0x3A, 0xB8] and row[512].item() == 127


def test_load_of_skipped_slot_is_zero_and_store_skips():
    cache = formats.encode_tokens(torch.randn(4, 128), "index_bf16")
    before = cache.clone()
    kv_store(cache, torch.tensor([-1, -1]), torch.randn(2, 128), "index_bf16")
    assert torch.equal(cache, before)
    out = kv_load(cache, torch.tensor([-1, 2]), "index_bf16")
    assert (out[0] == 0).all() and torch.equal(out[1], cache[2].view(torch.bfloat16).float())


@pytest.mark.parametrize("slots,match", [
    (torch.tensor([4]), r"slots must lie in \[0, 4\).*\[4, 4\]"),
    (torch.tensor([-2]), r"slots must lie in \[0, 4\)"),
    (torch.tensor([1], dtype=torch.int16), "slots must be int64"),
])
def test_bad_slots_raise(slots, match):
    cache = torch.zeros(4, 528, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        kv_store(cache, slots, torch.randn(1, 512), "fp8")
    with pytest.raises(ValueError, match=match):
        kv_load(cache, slots, "fp8")


def test_store_takes_int64_slots_only():
    cache = torch.zeros(4, 528, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"slots must be int64 \[n\]"):
        kv_store(cache, torch.tensor([1], dtype=torch.int32), torch.randn(1, 512), "fp8")


def test_bad_x_and_format_raise():
    cache = torch.zeros(4, 528, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x must be a float tensor \[n=1, dim=512\].*\(1, 128\)"):
        kv_store(cache, torch.tensor([0]), torch.randn(1, 128), "fp8")
    with pytest.raises(ValueError, match="unknown cache format 'fp6'"):
        kv_load(cache, torch.tensor([0]), "fp6")

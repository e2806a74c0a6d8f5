"""The ascend950 backend on a CPU: selecting it never imports torch_npu; native execution says
why it cannot run; device names map to platforms; every tile plan fits the A5 buffers and an
oversized one is refused; the emulation matches float64 within bounds that grow with K (ragged
tiles, experts without tokens, FP8 with packed scales), repeats bitwise across runs and thread
counts, writes each output element once; and the tiny model generates through it. The native
wrappers: ``test_ascend950_native.py``."""
import subprocess
import sys
import types

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.hal import OpTable, UnsupportedInput, get_backend
from deepinfer.hal.formats import quantize
from deepinfer_backends.ascend950 import EMULATED, Ascend950Backend
from deepinfer_backends.ascend950.buffers import ALIGNMENT, KIB, Buffer, TileBudgetError, layout
from deepinfer_backends.ascend950.emulate import grouped_gemm as gg
from deepinfer_backends.ascend950.emulate.plan import WriteRecord
from deepinfer_backends.ascend950.emulate.rms_norm import rms_norm, row_tile
from deepinfer_backends.ascend950.platform import native_status, platform_of

EMULATE = {"execution": "emulate"}


def test_selecting_the_backend_never_imports_torch_npu():
    code = ("import sys, deepinfer; from deepinfer.hal import OpTable, get_backend\n"
            "OpTable('ascend950', 'reference', options={'execution': 'emulate'})\n"
            "get_backend('ascend950').capabilities\n"
            "assert 'torch_npu' not in sys.modules, 'torch_npu was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_torch_npu_that_fails_to_import_makes_native_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    available, reason = native_status()
    assert not available and reason.startswith("torch_npu does not import (") and "halted" in reason
    with pytest.raises(RuntimeError, match=r"cannot run natively here: torch_npu does not import.*execution=emulate"):
        Ascend950Backend().implementations()


def test_native_execution_with_an_npu_serves_the_kernel_wrappers(monkeypatch):
    fake = types.SimpleNamespace(npu=types.SimpleNamespace(device_count=lambda: 1,
                                                           get_device_name=lambda i: "Ascend950PR"))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert native_status() == (True, "1 NPU(s), Ascend950PR")
    assert sorted(Ascend950Backend().implementations()) == sorted(EMULATED)
    broken = types.SimpleNamespace(npu=types.SimpleNamespace(device_count=lambda: 1 / 0))
    monkeypatch.setitem(sys.modules, "torch_npu", broken)
    assert native_status()[1].startswith("torch_npu imports but cannot count NPUs (ZeroDivisionError")


@pytest.mark.parametrize("name, platform", [("Ascend950PR", "A5"), ("ascend950dt", "A5"), ("Ascend910B3", "A2"),
                                            ("Ascend910_9391", "A3"), ("Ascend910C", "A3")])
def test_device_names_map_to_platforms(name, platform):
    assert platform_of(name) == platform


def test_an_unknown_device_name_is_an_error():
    with pytest.raises(ValueError, match="unknown Ascend device 'Ascend310P3'"):
        platform_of("Ascend310P3")


@pytest.mark.parametrize("key", ["bf16", "fp32", "fp8"])
def test_every_grouped_gemm_plan_fits_the_a5_buffers_aligned(key):
    tiles = gg.TILES[{"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": "fp8"}[key]]
    buffers = tiles.buffers(4)
    offsets = layout(buffers, "A5")
    for buffer in buffers:
        assert offsets[buffer.name] % ALIGNMENT[buffer.scope] == 0


@pytest.mark.parametrize("dim", [64, 128, 512, 1536, 4096, 7168])
def test_rms_norm_row_tiles_fit_the_a5_unified_buffer(dim):
    assert row_tile(dim, 2, "A5") >= 1 and row_tile(dim, 4, "A5") >= 1


@pytest.mark.parametrize("element", [2, 4])
def test_rope_row_tiles_fit_half_the_a5_unified_buffer(element):
    from deepinfer_backends.ascend950.emulate import apply_rope as ar

    rows = ar.row_tile(64, element, "A5")
    plan = ar.plan_buffers(rows, 64, element)
    offsets = layout(plan, "A5")
    assert rows >= 8 and offsets["gather_scratch"] + plan[-1].bytes <= 128 * KIB
    assert layout(ar.plan_buffers(rows + 1, 64, element), "A5")["gather_scratch"] + plan[-1].bytes > 128 * KIB


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4", "index_fp4", "index_bf16"])
def test_kv_store_row_tiles_fit_half_the_a5_unified_buffer(fmt):
    from deepinfer.hal.formats import token_format
    from deepinfer_backends.ascend950.emulate import kv_norm_rope_store as kv

    dim = token_format(fmt).dim
    rows = kv.row_tile(dim, 64, 2, fmt, "A5")
    plan = kv.plan_buffers(rows, dim, 64, 2, fmt)
    offsets = layout(plan, "A5")
    assert rows >= 8 and all(offsets[b.name] + b.bytes * b.copies <= 128 * KIB for b in plan)
    assert ("block_max" in offsets) == (fmt != "bf16" and fmt != "index_bf16")


@pytest.mark.parametrize("heads", [1, 3, 64])
def test_emulated_rope_tiles_rows_by_the_plan_and_matches_the_reference(heads, monkeypatch):
    from deepinfer.hal.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from deepinfer_backends.ascend950.emulate import apply_rope as ar

    tiles = []
    real = ar.run_row_tiles
    monkeypatch.setattr(ar, "run_row_tiles", lambda rows, tile, cores, body: (tiles.append(tile),
                                                                              real(rows, tile, cores, body)))
    gen = torch.Generator().manual_seed(heads)
    x = torch.randn(70, heads, 128, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 256, (70,), generator=gen)
    table = rope_cos_sin(rope_inv_freq(10000.0), 256)
    assert torch.equal(ar.apply_rope(x, positions, table, True), apply_rope(x, positions, table, True))
    assert tiles == [ar.row_tile(64, 2, "A5")]


def test_the_kv_store_kernel_refuses_what_it_cannot_store_with_the_reason():
    from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import kv_norm_rope_store_kernel

    args = dict(rows=16, dim=512, rope_dim=64, table_rows=256, cache_rows=32, tile_rows=8, vector_cores=2, eps=1e-6,
                offsets={})
    with pytest.raises(ValueError, match="stores formats .*'fp4'.*, got 'nvfp4'"):
        kv_norm_rope_store_kernel(fmt="nvfp4", **args)
    for fmt, values, dim in (("fp8", 512, 128), ("fp4", 512, 128), ("index_fp4", 128, 512)):
        with pytest.raises(ValueError, match=f"an {fmt} cache row holds {values} values, not dim={dim}"):
            kv_norm_rope_store_kernel(fmt=fmt, amax_floor=1e-4, **{**args, "dim": dim})
    for fmt, dim in (("fp8", 512), ("fp4", 512), ("index_fp4", 128)):
        with pytest.raises(ValueError, match="takes amax_floor"):
            kv_norm_rope_store_kernel(fmt=fmt, **{**args, "dim": dim})


@pytest.mark.parametrize("fmt, boundary, floor_byte", [("fp8", 0x600000, 105), ("mxfp4", 0x400000, 1)])
def test_the_stores_integer_scale_rules_are_the_formats_scales(fmt, boundary, floor_byte):
    """The kernel's scale byte from a block max's bits (no division) against ``ue8m0_scale``
    (a float32 division) over every exponent a floored max can have, the mantissas around the
    format's boundary (1.75 for e4m3's 448, 1.5 for e2m1's 6) and random ones."""
    from deepinfer.hal.formats import E2M1_MAX, E4M3_MAX, FP8_AMAX_FLOOR, MXFP4_AMAX_FLOOR, ue8m0_scale
    from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import fp8_scale_byte, mxfp4_scale_byte

    rule, fmt_max, floor = {"fp8": (fp8_scale_byte, E4M3_MAX, FP8_AMAX_FLOOR),
                            "mxfp4": (mxfp4_scale_byte, E2M1_MAX, MXFP4_AMAX_FLOOR)}[fmt]
    exponents = torch.arange(1, 255, dtype=torch.int32)
    edges = torch.tensor([0, 1, boundary - 1, boundary, boundary + 1, 0x7FFFFE, 0x7FFFFF], dtype=torch.int32)
    mantissas = torch.cat((edges, torch.randint(0, 1 << 23, (64,), generator=torch.Generator().manual_seed(0),
                                                dtype=torch.int32)))
    bits = ((exponents[:, None] << 23) | mantissas[None, :]).flatten()
    amax = bits.view(torch.float32)
    amax = torch.cat((torch.tensor([floor], dtype=torch.float32), amax[amax >= floor]))
    got = rule(amax.view(torch.int32), lambda value, shift: value >> shift)
    want = ue8m0_scale(amax, fmt_max, floor).to(torch.int32)
    assert amax.numel() > 10000 and got[0] == floor_byte
    assert torch.equal(got, want), (amax[got != want][:5], got[got != want][:5], want[got != want][:5])


def test_the_fp4_stores_e4m3_scales_and_reciprocals_are_the_formats():
    """The ``fp4`` store's scale, emulated op for op in float32 (the hardware's cast to e4m3 by
    torch's, both round to nearest even): the block max at least the floor, times the float32
    whose bits are :data:`SIXTH_BITS`, at most 448, to e4m3; against ``nvfp4_scale`` over 40
    binades (from below the floor to past the saturation at 448), with the mantissas at the e4m3
    rounding ties, next to them and random.
    The reciprocal from the scale's bits against ``1 / scale`` (a float32 division) over every
    positive e4m3 value."""
    from deepinfer.hal.formats import NVFP4_AMAX_FLOOR, nvfp4_scale
    from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import SIXTH_BITS, e4m3_reciprocal_bits

    sixth = torch.tensor([SIXTH_BITS], dtype=torch.int32).view(torch.float32)
    assert sixth.item() == torch.tensor(1 / 6, dtype=torch.float32).item()
    exponents = torch.arange(100, 140, dtype=torch.int32)
    ties = torch.tensor([(2 * i + 1) << 19 for i in range(8)], dtype=torch.int32)  # halfway between e4m3 mantissas
    edges = torch.cat((ties - 1, ties, ties + 1, torch.tensor([0, 1, 0x7FFFFF], dtype=torch.int32)))
    mantissas = torch.cat((edges, torch.randint(0, 1 << 23, (64,), generator=torch.Generator().manual_seed(0),
                                                dtype=torch.int32)))
    amax = ((exponents[:, None] << 23) | mantissas[None, :]).flatten().view(torch.float32) * 6
    amax = torch.cat((amax, torch.tensor([0.0, NVFP4_AMAX_FLOOR, 2688.0, 3000.0, 1e6])))
    scaled = (amax.clamp_min(NVFP4_AMAX_FLOOR) * sixth).clamp_max(448.0)
    got = scaled.to(torch.float8_e4m3fn)
    want = nvfp4_scale(amax)
    assert amax.numel() > 3000 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = codes[torch.isfinite(codes) & (codes > 0)]
    recip = e4m3_reciprocal_bits(scales.view(torch.int32), lambda value, shift: value >> shift,
                                 lambda condition: condition.to(torch.int32))
    assert scales.numel() == 126 and torch.equal(recip.to(torch.int32).view(torch.float32), 1.0 / scales)


@pytest.mark.parametrize("fmt", ["index_fp4", "fp4"])
def test_the_fp4_stores_e2m1_rounding_and_decoding_are_the_formats(fmt):
    """The FP4 stores' e2m1 rounding and decoding, emulated op for op in float32 (``2^30`` as the
    lowering prints it): the sign ``8 * clamp(-v * 2^100 * 2^100, 0, 1)`` into the codes, each step
    of ``E2M1_STEPS`` ``clamp((|v| - t) * 2^30 [+ 1], 0, 1)`` added to them, then the decoded value
    ``max(2m - 8, m - 2, m / 2) * (1 - 2n)`` of ``n = clamp(code - 7, 0, 1)``, ``m = code - 8n``.
    Against ``e2m1_codes`` and ``e2m1_values``: for ``index_fp4`` over every finite bf16 value
    scaled by powers of two from 2^-20 to 2^20 (its keys times an exact reciprocal), for ``fp4``
    over bf16 keys times every e4m3 scale's reciprocal (rounded products) and the float32 values
    next to every threshold; ``-0.0`` aside (code 0 here, 8 in the format: both decode to zero)."""
    from deepinfer.hal.formats import e2m1_codes, e2m1_values
    from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import E2M1_STEPS

    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[torch.isfinite(values)]
    if fmt == "index_fp4":
        scaled = torch.cat([values * 2.0 ** e for e in range(-20, 21, 4)])
        limit = 6.0
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        reciprocals = 1.0 / codes[torch.isfinite(codes) & (codes > 0)]
        keys = values[(values.abs() > 2.0 ** -12) & (values.abs() < 2.0 ** 12)][::3]
        thresholds = torch.tensor([t for t, _ in E2M1_STEPS])
        near = torch.cat([torch.nextafter(thresholds, torch.tensor(inf)) for inf in (0.0, 100.0)] + [thresholds])
        scaled = torch.cat([(keys[:, None] * reciprocals[None, :]).flatten(), near, -near])
        limit = 6.0 * 17 / 16  # a block max over its scale, rounded down to e4m3, stays below
    scaled = scaled[(scaled.abs() <= limit) & ~((scaled == 0) & torch.signbit(scaled))]
    large = torch.tensor(2.0 ** 30 + 128, dtype=torch.float32)  # "1.073742e+09f"
    code = (scaled * -(2.0 ** 100) * 2.0 ** 100).clamp(0.0, 1.0) * 8
    for threshold, inclusive in E2M1_STEPS:
        step = ((scaled.abs() - threshold) * large + (1.0 if inclusive else 0.0)).clamp(0.0, 1.0)
        assert torch.all((step == 0) | (step == 1)), threshold
        code = code + step
    negative = (code - 7).clamp(0.0, 1.0)
    m = code - 8 * negative
    decoded = torch.maximum(torch.maximum(2 * m - 8, m - 2), (m - 2) * 0.5 + 1) * (1 - 2 * negative)
    want = e2m1_codes(scaled)
    assert scaled.numel() > 100000 and torch.equal(code.to(torch.uint8), want)
    assert torch.equal(decoded, e2m1_values(want))


def test_the_decodes_fp4_row_arithmetic_is_the_formats_decoding():
    """The MLA decode's ``fp4`` row decode, emulated op for op in float32: the code bytes widened,
    the high nibbles ``floor(byte / 16)``, the low ones ``byte - 16 * high``, each code's value
    ``max(2m - 8, m - 2, m / 2) * (1 - 2n)``, the values put in row order by the kernel's gather
    offsets, times the e4m3 scales and rounded to bf16; against ``decode_tokens`` on rows holding
    every code byte under every positive e4m3 scale."""
    from deepinfer.hal.formats import decode_tokens

    codes = torch.arange(256, dtype=torch.uint8)
    scale_bytes = torch.arange(256, dtype=torch.uint8)
    scale_bytes = scale_bytes[torch.isfinite(scale_bytes.view(torch.float8_e4m3fn).float())
                              & (scale_bytes.view(torch.float8_e4m3fn).float() > 0)]
    rows = torch.stack([codes.roll(r) for r in range(scale_bytes.numel())])
    scales = scale_bytes[(torch.arange(32)[None, :] + torch.arange(rows.shape[0])[:, None]) % scale_bytes.numel()]
    cache = torch.cat((rows, scales.to(torch.uint8)), dim=1)
    nibbles = 256
    v = cache[:, :nibbles].to(torch.float16).float()
    high = torch.floor(v * 0.0625)
    low = v - 16 * high
    pairs = torch.cat((low, high), dim=1)
    negative = (pairs - 7).clamp(0.0, 1.0)
    pairs = pairs - 8 * negative
    signs = 1 - 2 * negative
    flat = torch.maximum(torch.maximum(2 * pairs - 8, pairs - 2), (pairs - 2) * 0.5 + 1)
    pairs = flat * signs
    offsets = torch.tensor([(i % 2 * nibbles + i // 2) * 4 for i in range(512)])
    values = pairs[:, offsets // 4]
    widened = cache[:, nibbles:].contiguous().view(torch.float8_e4m3fn).float()
    got = (values.reshape(-1, 32, 16) * widened[:, :, None]).reshape(-1, 512).to(torch.bfloat16)
    want = decode_tokens(cache, "fp4")
    assert scale_bytes.numel() == 126 and torch.equal(got.float(), want)


def test_an_oversized_plan_is_refused():
    with pytest.raises(TileBudgetError, match=r"UB holds 256 KiB per AI core on A5, but \['big'\] need 768 KiB"):
        layout((Buffer("big", "UB", 768 * KIB),), "A5")
    with pytest.raises(TileBudgetError, match="L0C holds 128 KiB per AI core on A3"):
        layout((Buffer("acc", "L0C", 128 * 384 * 4),), "A3")  # 192 KiB: fits A5, not A3
    assert layout((Buffer("a", "L0A", 100), Buffer("b", "L0A", 100)), "A5") == {"a": 0, "b": 512}


def _float64_bound(a: torch.Tensor, b: torch.Tensor, k: int, out_dtype: torch.dtype):
    """The exact product in float64 and a bound for float32 accumulation over ``k`` terms
    (``k * 2^-24 * sum |a||b|``), plus half an ulp of ``out_dtype`` at the output's size."""
    exact = a.double() @ b.double().T
    bound = k * 2.0 ** -24 * (a.double().abs() @ b.double().abs().T)
    if out_dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0 ** -8
    return exact, bound + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 320, 2048])
def test_grouped_gemm_matches_float64_within_a_bound_growing_with_k(dtype, k):
    gen = torch.Generator().manual_seed(k)
    sizes = [0, 130, 1, 0, 257]  # experts with no tokens; ragged row tiles (base_m 128)
    n = 300  # ragged column tiles (base_n 256 / 128)
    x = torch.randn(sum(sizes) + 3, k, generator=gen).to(dtype)  # 3 rows past the last segment
    w = torch.randn(len(sizes), n, k, generator=gen).to(dtype)
    out = gg.grouped_gemm(x, w, torch.tensor(sizes))
    start = 0
    for e, size in enumerate(sizes):
        exact, bound = _float64_bound(x[start:start + size], w[e], k, dtype)
        assert ((out[start:start + size].double() - exact).abs() <= bound).all(), f"expert {e}"
        start += size
    assert not out[start:].any(), "rows after the last segment are not written"


def test_fp8_grouped_gemm_applies_both_scales_per_block():
    gen = torch.Generator().manual_seed(1)
    sizes, k, n = [70, 0, 129], 256, 260
    x = quantize(torch.randn(sum(sizes), k, generator=gen) * 3, "fp8")
    w = quantize(torch.randn(len(sizes), n, k, generator=gen) * 0.02, "fp8")
    out = gg.grouped_gemm(x, w, torch.tensor(sizes))
    assert out.dtype == torch.float32
    xv, wv = x.dequantize(), w.dequantize()
    start = 0
    for e, size in enumerate(sizes):
        exact, bound = _float64_bound(xv[start:start + size], wv[e], k, torch.float32)
        assert ((out[start:start + size].double() - exact).abs() <= bound).all(), f"expert {e}"
        start += size


def test_mixed_operands_are_declined_with_the_reason():
    x = torch.randn(4, 64)
    w = quantize(torch.randn(2, 8, 64), "mxfp4")
    with pytest.raises(UnsupportedInput, match="got x float32 and weight mxfp4"):
        gg.grouped_gemm(x, w, torch.tensor([2, 2]))


def test_scales_pack_two_per_int16_low_byte_first():
    assert gg.pack_scales(torch.tensor([[127, 128, 3]], dtype=torch.uint8)).tolist() == [[0x807F - 0x10000, 0x7F03]]
    scales = torch.randint(0, 256, (5, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gg.unpack_scales(gg.pack_scales(scales), 9), scales)


def test_results_repeat_bitwise_across_runs_and_thread_counts():
    gen = torch.Generator().manual_seed(3)
    x, w, sizes = torch.randn(300, 512, generator=gen), torch.randn(3, 384, 512, generator=gen), torch.tensor([100, 0, 200])
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            runs.append((gg.grouped_gemm(x, w, sizes), rms_norm(x, torch.ones(512), 1e-6)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, runs[0][0]) and torch.equal(b, runs[0][1]) for a, b in runs)


def test_an_output_element_stored_twice_or_never_is_caught():
    record = WriteRecord(4, 4)
    record.store(slice(0, 4), slice(0, 2))
    with pytest.raises(AssertionError, match="overlap or leave gaps"):
        record.check(4)
    record.store(slice(0, 4), slice(2, 4))
    record.check(4)
    record.store(slice(1, 2), slice(0, 4))
    with pytest.raises(AssertionError, match=r"range 1\.\.2"):
        record.check(4)


def test_the_op_table_serves_the_emulated_ops_and_falls_back_for_the_rest():
    table = OpTable("ascend950", "reference", options=EMULATE)
    assert table.sources["grouped_gemm"] == "ascend950" and table.sources["rms_norm"] == "ascend950"
    assert table.sources["mla_sparse_decode"] == "ascend950" and table.sources["mhc_mixes"] == "reference"
    assert "emulated" in get_backend("ascend950", EMULATE).label


def test_tiny_model_greedy_through_the_emulation_agrees_with_the_reference():
    prompts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny", "reference", ["engine.use_tqdm=false"]).generate(prompts, params)]
    llm = LLM("tiny", "ascend950", ["backend.execution=emulate", "backend.fallback=reference", "engine.use_tqdm=false"])
    got = [o.token_ids for o in llm.generate(prompts, params)]
    pairs = [(a, b) for x, y in zip(want, got) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.99


@pytest.mark.parametrize("keys", [64, 200, 1000])
def test_sparse_prefill_matches_float64_attention_with_a_sink(keys):
    """Online softmax over tiles of 64 keys (two lists when ``main_keys`` splits them) against the
    float64 softmax with the sink; a query whose keys are all padding gets 0 and lse -inf."""
    from deepinfer_backends.ascend950.emulate.mla import mla_sparse_prefill

    gen = torch.Generator().manual_seed(keys)
    tokens, heads, dim, rows = 5, 3, 512, 1500
    q, kv = torch.randn(tokens, heads, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    indices = torch.randint(0, rows, (tokens, keys), generator=gen, dtype=torch.int32)
    indices[1, keys // 3:] = -1
    indices[4] = -1
    sink, scale = torch.randn(heads, generator=gen), dim ** -0.5
    out, lse = mla_sparse_prefill(q, kv, indices, sink, scale, main_keys=keys // 2)
    k64 = kv.double()[indices.clamp(min=0).long()]
    logits = scale * torch.einsum("thd,tkd->thk", q.double(), k64).masked_fill((indices < 0)[:, None], float("-inf"))
    want_lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - want_lse[..., None]).nan_to_num(0.0)
    want = torch.einsum("thk,tkd->thd", probs, k64) * torch.sigmoid(want_lse - sink.double())[..., None]
    assert torch.equal(out[4], torch.zeros_like(out[4])) and torch.isinf(lse[4]).all()
    assert (out[:4].double() - want[:4]).abs().max() <= keys * 2.0 ** -22
    assert (lse[:4].double() - want_lse[:4]).abs().max() <= keys * 2.0 ** -22

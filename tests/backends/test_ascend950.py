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
    with pytest.raises(NotImplementedError, match="'fp4' yet .*e4m3 scales per 16"):
        kv_norm_rope_store_kernel(fmt="fp4", **args)
    with pytest.raises(ValueError, match="512 values, not dim=128"):
        kv_norm_rope_store_kernel(fmt="fp8", amax_floor=1e-4, **{**args, "dim": 128})
    with pytest.raises(ValueError, match="128 values, not dim=512"):
        kv_norm_rope_store_kernel(fmt="index_fp4", amax_floor=1e-4, **args)
    for fmt, dim in (("fp8", 512), ("index_fp4", 128)):
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


def test_the_index_fp4_stores_e2m1_steps_are_the_formats_rounding():
    """The kernel's e2m1 rounding, emulated op for op in float32: per step of ``E2M1_STEPS``
    ``clamp((a - t) * 2^30 [+ 1], 0, 1)`` summed into the code and, by value, into the decoded
    magnitude; the sign from ``clamp(-v * 2^100 * 2^100, 0, 1)``. Against ``e2m1_codes`` and
    ``e2m1_values`` over every finite bf16 value scaled by powers of two from 2^-20 to 2^20
    (the ties at every threshold among them), ``-0.0`` aside (the kernel gives it code 0, the
    format 8: both decode to zero)."""
    from deepinfer.hal.formats import e2m1_codes, e2m1_values
    from deepinfer_backends.ascend950.kernels.kv_norm_rope_store import E2M1_STEPS

    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[torch.isfinite(values)]
    scaled = torch.cat([values * 2.0 ** e for e in range(-20, 21, 4)])
    scaled = scaled[(scaled.abs() <= 6.0) & ~((scaled == 0) & torch.signbit(scaled))]
    a = scaled.abs()
    code, decoded = torch.zeros_like(a), torch.zeros_like(a)
    for threshold, inclusive, value in E2M1_STEPS:
        step = ((a - threshold) * 2.0 ** 30 + (1.0 if inclusive else 0.0)).clamp(0.0, 1.0)
        assert torch.all((step == 0) | (step == 1)), threshold
        code, decoded = code + step, decoded + step * value
    negative = (scaled * -(2.0 ** 100) * 2.0 ** 100).clamp(0.0, 1.0)
    code, decoded = code + 8 * negative, decoded * (1 - 2 * negative)
    want = e2m1_codes(scaled)
    assert scaled.numel() > 100000 and torch.equal(code.to(torch.uint8), want)
    assert torch.equal(decoded, e2m1_values(want))


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

"""The sm100 Triton kernels against the reference on every case of their op but the real-size
ones, run by Triton's interpreter on the CPU (a subprocess: the interpreter is chosen when triton
is imported). The parity grid runs them all on a GPU (``tests/hal/test_parity.py``)."""
import importlib.util
import os
import subprocess
import sys

import pytest

OPS = ("mhc_mixes", "mhc_head", "mhc_pre", "mhc_post", "mhc_post_pre", "apply_rope", "ep_combine", "kv_load",
       "swiglu")

CHECK = """
import sys
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100 import wrappers

for op in sys.argv[1:]:
    spec = SPECS[op]
    for case in (c for c in spec.cases if c.size != "real"):  # real sizes: minutes in the interpreter
        inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
        got = getattr(wrappers, op)(**inputs)
        failures = compare(got, spec.reference(**inputs), spec.tolerance(case.dtype or torch.float32), case.name)
        assert not failures, failures
        print(op, case.name, "ok")
"""


def interpreted(script: str, *args: str) -> str:
    """The standard output of ``script`` (with ``args``) run by Python under Triton's interpreter;
    fails the test with its error output when it fails."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_the_reference_in_the_interpreter():
    from deepinfer.hal.spec import SPECS
    import deepinfer.hal.ops  # noqa: F401

    expected = [f"{op} {case.name} ok" for op in OPS for case in SPECS[op].cases if case.size != "real"]
    assert interpreted(CHECK, *OPS).splitlines() == expected


ONE_PASS = """
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100 import mhc

gen = torch.Generator().manual_seed(0)
hc, hidden = 4, 64
for op, extra in (("mhc_mixes", {"sinkhorn_iters": 20}), ("mhc_head", {}),
                  ("mhc_mixes", {"sinkhorn_iters": 8, "sinkhorn_order": "column_row"})):
    rows = hc * (2 + hc) if op == "mhc_mixes" else hc
    args = {"fn": torch.randn(rows, hc * hidden, generator=gen) * 0.02, "scale": torch.rand(3 if extra else 1) + 0.5,
            "base": torch.randn(rows, generator=gen) * 0.1, "norm_eps": 1e-6, "hc_eps": 1e-6, **extra}
    for tokens in (1, 5, 64, 65):
        residual = torch.randn(tokens, hc, hidden, generator=gen).bfloat16()
        one_pass = getattr(mhc, op)(residual, **args)
        two = getattr(mhc, op)(residual, **args, batch_invariant=True)
        want = SPECS[op].reference(residual, **args)
        for got in (one_pass, two):
            failures = compare(got, want, SPECS[op].tolerance(torch.float32), f"{op}/{tokens}")
            assert not failures, failures
        assert int(mhc._ARRIVALS[torch.device("cpu")].abs().sum()) == 0, "the arrival counters return to zero"
        print(op, tokens, "ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mhc_one_pass_and_two_launches_match_the_reference_in_the_interpreter():
    lines = interpreted(ONE_PASS).splitlines()
    assert lines == [f"{op} {tokens} ok" for op in ("mhc_mixes", "mhc_head", "mhc_mixes") for tokens in (1, 5, 64, 65)]


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
q[1, 2, 32:64] = 1.75 * 2.0 ** -126  # under the floor: scale 2^-126 all the same, 1.75 a tie to code 4
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
    assert interpreted(CAST).split("\n")[0] == "mxfp4 cast ok"


ROPE_OUT = """
import torch
from deepinfer.hal.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from deepinfer_backends.sm100 import wrappers

gen = torch.Generator().manual_seed(0)
table = rope_cos_sin(rope_inv_freq(10000.0), 64)
positions = torch.randint(0, 64, (5,), generator=gen)
for conjugate in (False, True):
    q = torch.randn(5, 3, 160, generator=gen).bfloat16()
    separate = wrappers.apply_rope(q[..., 96:], positions, table, conjugate=conjugate)
    want = apply_rope(q, positions, table, conjugate=conjugate)
    tail = q[..., 96:]
    assert wrappers.apply_rope(tail, positions, table, conjugate=conjugate, out=tail).data_ptr() == tail.data_ptr()
    assert torch.equal(tail, separate), "in place, the kernel writes what it returns out of place"
    assert torch.allclose(q.float(), want.float(), atol=2e-2, rtol=2e-2), (q.float() - want.float()).abs().max()
    rows = torch.randn(5, 4, 64, generator=gen).bfloat16()
    uneven = torch.zeros(5, 6, 64, dtype=torch.bfloat16)[:, :4]  # rows not evenly spaced: written by a copy
    wrappers.apply_rope(rows, positions, table, conjugate=conjugate, out=uneven)
    assert torch.equal(uneven, wrappers.apply_rope(rows, positions, table, conjugate=conjugate))
    whole = wrappers.apply_rope(q0 := torch.randn(5, 3, 400, generator=gen).bfloat16(), positions, table,
                                conjugate=conjugate)  # 336 columns copied in 128-column steps
    assert torch.equal(whole[..., :336], q0[..., :336])
    torch.testing.assert_close(whole.float(), apply_rope(q0, positions, table, conjugate=conjugate).float(),
                               atol=2e-2, rtol=2e-2)
    narrow = rope_cos_sin(rope_inv_freq(10000.0, 48), 64)  # a rotated slice of 48: 24 pairs in 32 lanes
    rows = torch.randn(5, 2, 80, generator=gen)
    torch.testing.assert_close(wrappers.apply_rope(rows, positions, narrow, conjugate=conjugate),
                               apply_rope(rows, positions, narrow, conjugate=conjugate), atol=1e-5, rtol=1e-5)
print("rope out ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_rope_kernel_writes_out_in_place_in_the_interpreter():
    assert interpreted(ROPE_OUT).split("\n")[0] == "rope out ok"


SCHEDULE = """
import torch
from deepinfer.hal.ops.grouped_gemm import tile_bounds
from deepinfer_backends.sm100.fused.tile_schedule import tile_schedule

# by hand: sizes 3, 0, 5 in tiles of 2 rows -> expert 0 rows 0-2 (2 tiles), expert 2 rows 3-8 (3 tiles), rest unused
got = tile_schedule(torch.tensor([3, 0, 5]), 8, 2)
assert got.tolist() == [[0, 0, 2, 2, 2, 3, 3], [0, 2, 3, 5, 7, 9, 11], [3, 3, 8, 8, 8, 8, 8]], got.tolist()
gen = torch.Generator().manual_seed(0)
for experts, rows_each, tile_rows in [(1, 5, 64), (1, 0, 64), (3, 7, 4), (48, 200, 128), (384, 11, 64), (257, 64, 128)]:
    sizes = torch.randint(0, 2 * rows_each + 1, (experts,), generator=gen)
    rows = int(sizes.sum())
    want = torch.stack(tile_bounds(sizes, rows, tile_rows)).to(torch.int32)
    assert torch.equal(tile_schedule(sizes, rows, tile_rows), want), (experts, rows_each, tile_rows)
print("tile schedule ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tile_schedule_kernel_gives_the_reference_tiles_in_the_interpreter():
    assert interpreted(SCHEDULE).split("\n")[0] == "tile schedule ok"


SKINNY = """
import torch
from deepinfer.hal.ops.activation import swiglu
from deepinfer.hal.ops.grouped_gemm import grouped_gemm
from deepinfer_backends.sm100.fused.grouped_gemm_skinny import BLOCK_T, grouped_gemm_skinny
from deepinfer_backends.sm100.fused.tile_schedule import tile_schedule

gen = torch.Generator().manual_seed(0)
# float32 operands: the interpreter's tl.dot mishandles bf16 (the GPU parity grid runs bf16).
# An empty expert, one spanning two tiles, K past a whole K step, N past a whole column block.
for sizes, n, k in [([2, 0, 1, 3], 48, 64), ([0, 19, 1], 40, 136), ([1], 16, 16)]:
    sizes = torch.tensor(sizes)
    rows = int(sizes.sum())
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen)
    want = grouped_gemm(x.double(), w.double(), sizes)
    for schedule in (tile_schedule(sizes, rows, BLOCK_T), sizes):  # a schedule, or worked out in the kernel
        y = torch.full((rows, n), float("nan"))
        grouped_gemm_skinny(x, w, schedule, y)
        assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (sizes, n, k)
    up = torch.randn(len(sizes), n, k, generator=gen)
    for limit in (None, 2.0):  # the gated variant: SwiGLU of the gate (w) and up products
        gated = torch.full((rows, n), float("nan"))
        grouped_gemm_skinny(x, w, sizes, gated, up=up, limit=limit)
        want = swiglu(grouped_gemm(x.double(), w.double(), sizes), grouped_gemm(x.double(), up.double(), sizes), limit)
        assert torch.allclose(gated.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (sizes, limit)
print("skinny ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_skinny_grouped_gemm_and_its_swiglu_match_float64_in_the_interpreter():
    assert interpreted(SKINNY).split("\n")[0] == "skinny ok"


STACKED = """
import torch
from deepinfer_backends.sm100.fused.linear_skinny import BLOCK_T, MAX_WEIGHTS, linear_skinny

gen = torch.Generator().manual_seed(0)
# float32 operands: the interpreter's bf16 tl.dot is not the GPU's; one launch up to MAX_WEIGHTS weights, then more
for widths, k, rows in (((64, 32, 16), 96, 5), ((48,), 64, BLOCK_T + 1), ((16, 32, 16, 48, 16, 32, 64), 40, 3),
                        ((16, 16), 300, 0)):
    x = torch.randn(rows, k, generator=gen)
    weights = [torch.randn(n, k, generator=gen) / k ** 0.5 for n in widths]
    got = linear_skinny(x, weights)
    assert len(widths) > MAX_WEIGHTS or len(got) == len(widths)
    for product, weight in zip(got, weights, strict=True):
        want = x.double() @ weight.double().T
        assert product.is_contiguous() and product.shape == want.shape
        assert torch.allclose(product.double(), want, rtol=1e-5, atol=1e-5), (widths, rows)
# RoPE in the epilogue: the HAL stacked_linear's reference, per head of each named product
from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq
from deepinfer.hal.ops.stacked_linear import stacked_linear
for widths, heads, rope, tiles, rows in (((64, 48, 32), (32, 0, 16), 8, None, 5), ((128, 64), (64, 32), 32, None, 3),
                                         ((96, 64), (96, 64), 64, {"block_n": 16, "block_k": 32, "warps": 4,
                                                                   "stages": 2}, BLOCK_T + 2)):
    x = torch.randn(rows, 40, generator=gen)
    weights = [torch.randn(n, 40, generator=gen) / 40 ** 0.5 for n in widths]
    positions = torch.randint(0, 300, (rows,), generator=gen)
    table = rope_cos_sin(rope_inv_freq(10000.0, rope), 300)
    got = linear_skinny(x, weights, tiles, rope=(positions, table, list(heads)))
    want = stacked_linear(x, weights, positions, table, heads)
    for product, expected, head in zip(got, want, heads, strict=True):
        assert torch.allclose(product, expected, rtol=1e-5, atol=1e-5), (widths, heads, head)
        if head:  # the rotation moved the tails, and only them
            plain = x @ weights[heads.index(head)].T
            cols = torch.arange(product.shape[1]) % head >= head - rope
            assert torch.allclose(product[:, ~cols], plain[:, ~cols], atol=1e-5)
            assert not torch.allclose(product[:, cols], plain[:, cols], atol=1e-3)
# SwiGLU of the last two products in the epilogue
for widths, limit, rows in (((16, 32, 32), None, 3), ((64, 64), 1.5, BLOCK_T + 1)):
    x = 3 * torch.randn(rows, 96, generator=gen)
    weights = [torch.randn(n, 96, generator=gen) / 96 ** 0.5 for n in widths]
    got = linear_skinny(x, weights, gated=True, limit=limit)
    want = stacked_linear(x, weights, swiglu=True, swiglu_limit=limit)
    assert len(got) == len(want) == len(widths) - 1, (len(got), len(want))
    for product, expected in zip(got, want, strict=True):
        assert product.shape == expected.shape and torch.allclose(product, expected, rtol=1e-5, atol=1e-5), widths
# the input's RMSNorm in the kernel, alone and with the RoPE and SwiGLU epilogues
for widths, rows, extra in (((48, 32), 3, {}), ((64, 32), BLOCK_T + 1, {"rope": 16}),
                            ((16, 32, 32), 2, {"swiglu": True, "swiglu_limit": 2.0})):
    x = 4 * torch.randn(rows, 72, generator=gen)
    weights = [torch.randn(n, 72, generator=gen) / 72 ** 0.5 for n in widths]
    gain = 1 + 0.2 * torch.randn(72, generator=gen)
    rope = None
    if "rope" in extra:
        positions, table = torch.randint(0, 50, (rows,), generator=gen), rope_cos_sin(rope_inv_freq(10000.0, 16), 50)
        rope, extra = (positions, table, [32, 0]), {"positions": positions, "cos_sin": table, "rope_heads": [32, 0]}
    got = linear_skinny(x, weights, rope=rope, gated="swiglu" in extra, limit=extra.get("swiglu_limit"),
                        norm=(gain, 1e-6))
    want = stacked_linear(x, weights, norm_weight=gain, norm_eps=1e-6, **extra)
    plain = stacked_linear(x, weights, **extra)
    for product, expected, raw in zip(got, want, plain, strict=True):
        assert torch.allclose(product, expected, rtol=1e-5, atol=1e-5), (widths, extra)
        assert not torch.allclose(product, raw, rtol=1e-2, atol=1e-2), widths
# MXFP4 casts in the epilogue (after the RoPE), of the named products only, over two launches' weights
for widths, rows, mxfp4, rope in (((64, 32), 3, (1,), None), ((64, 32, 32, 32, 32, 64), BLOCK_T + 1, (0, 5), None),
                                  ((128, 64), 4, (0, 1), 16)):
    x = torch.randn(rows, 40, generator=gen)
    weights = [torch.randn(n, 40, generator=gen) / 40 ** 0.5 for n in widths]
    extra = {}
    if rope:
        positions, table = torch.randint(0, 50, (rows,), generator=gen), rope_cos_sin(rope_inv_freq(10000.0, rope), 50)
        extra = {"positions": positions, "cos_sin": table, "rope_heads": [64, 32]}
    got = linear_skinny(x, weights, rope=(positions, table, [64, 32]) if rope else None, mxfp4=mxfp4)
    want = stacked_linear(x, weights, mxfp4_products=mxfp4, **extra)
    for i, (product, expected) in enumerate(zip(got, want, strict=True)):
        assert torch.allclose(product, expected, rtol=1e-5, atol=1e-5), (widths, i)
        assert (i in mxfp4) == (product.unique().numel() < product.numel() // 2), (widths, i)  # on a coarse grid
print("stacked ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_stacked_linear_kernel_stores_each_product_apart_in_the_interpreter():
    assert interpreted(STACKED).split("\n")[0] == "stacked ok"


E4M3_DECODE = """
import torch
import triton
import triton.language as tl
from deepinfer.hal.formats import Quantized
from deepinfer_backends.sm100.fused.linear_skinny import e4m3_to_bf16


@triton.jit
def decode(codes, scales, out, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1) * BLOCK_K
    at = local[:, None] * k + step + tl.arange(0, BLOCK_K)[None, :]
    values = e4m3_to_bf16(tl.load(codes + at), scales + local[:, None] * (k // 32), step, k, local >= 0,
                          BLOCK_N, BLOCK_K)
    tl.store(out + at, values)


# every e4m3 code (NaN aside) under every scale byte whose products are bf16 normals and finite
codes = torch.arange(256, dtype=torch.uint8).repeat(240, 1)
codes[(codes & 0x7F) == 0x7F] = 0
scales = (10 + torch.arange(240 * 8) % 237).to(torch.uint8).view(240, 8)
out = torch.empty(240, 256, dtype=torch.bfloat16)
decode[(240 // 16, 256 // 64)](codes, scales, out, 256, BLOCK_N=16, BLOCK_K=64)
want = Quantized(codes.view(torch.float8_e4m3fn), scales, "fp8", 32).dequantize().float()
assert set(scales.unique().tolist()) == set(range(10, 247))
assert torch.equal(out.float(), want), (out.float() - want).abs().max()
print("e4m3 decode ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fp8_weight_decode_of_the_kernel_for_few_rows_is_exact_in_the_interpreter():
    assert interpreted(E4M3_DECODE).split("\n")[0] == "e4m3 decode ok"


PARTIALS = """
import torch
from deepinfer_backends.sm100.fused.mhc_mixes import bf16_parts
from deepinfer_backends.sm100.mhc import _partials

gen = torch.Generator().manual_seed(0)
fn = torch.randn(24, 4 * 300, generator=gen) * torch.exp2(torch.randint(-8, 8, (24, 1), generator=gen).float())
parts = bf16_parts(fn)
assert parts.dtype == torch.bfloat16 and torch.equal(parts.double().sum(0), fn.double())  # exact: 3 x 8 bits
residual = torch.randn(7, 4, 300, generator=gen).to(torch.bfloat16)
dots, squares, splits, rows = _partials(residual, torch.nn.Parameter(fn, requires_grad=False))
flat = residual.reshape(7, -1).double()
want = flat @ fn.double().T
got = dots.double().sum(0)[:, :24]
error = ((got - want).abs() / (flat.abs() @ fn.double().abs().T)).max().item()
assert error < 2 ** -23, error  # float32 accumulation; with two parts about 2 ** -22, one 2 ** -12
assert torch.allclose(squares.double().sum(0), (flat ** 2).sum(1), rtol=1e-6)
print("partials ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_mix_partials_of_a_bf16_residual_keep_float32_precision_in_the_interpreter():
    assert interpreted(PARTIALS).split("\n")[0] == "partials ok"

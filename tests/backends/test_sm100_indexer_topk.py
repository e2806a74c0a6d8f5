"""The sm100 ``indexer_topk`` kernel: exact against the reference under Triton's interpreter (a
subprocess: the interpreter is chosen when triton is imported) on every OpSpec case (the small
ones again with small blocks) and on edge cases (ties across the k-th value, short and empty windows, -inf, signed zeros, rows longer than
a kernel block), and compiled for sm_90 with the constexprs the wrapper uses."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.backends.triton_cubin import hopper_cubin

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = """
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.spec import SPECS
from deepinfer_backends.sm100.fused import indexer_topk as kernel_module
from deepinfer_backends.sm100.indexer_topk import indexer_topk

spec, gen = SPECS["indexer_topk"], torch.Generator().manual_seed(0)


def check(name, logits, starts, lengths, k, row_table=None):
    starts, lengths = torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    got = indexer_topk(logits, starts, lengths, k, row_table)
    want = spec.reference(logits.float(), starts, lengths, k, row_table)
    assert got.dtype == torch.int32 and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    assert torch.equal(got, want), (name, (got != want).nonzero()[:5].tolist(), got[:2], want[:2])
    print(name, "ok")


for case in spec.cases:
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    check(case.name, inputs["logits"], inputs["starts"].tolist(), inputs["lengths"].tolist(), inputs["k"],
          inputs.get("row_table"))

# Small blocks: rows span several blocks, and both the candidate path and the whole-row select run
# (the real-size cases once, above: minutes more in the interpreter).
kernel_module.BLOCK, kernel_module.CANDIDATES = 64, 128
for case in (c for c in spec.cases if c.size != "real"):
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    check(case.name + "_small_blocks", inputs["logits"], inputs["starts"].tolist(), inputs["lengths"].tolist(),
          inputs["k"], inputs.get("row_table"))

width = 301
ties = torch.randint(0, 4, (6, width), generator=gen).float()
check("ties_across_kth", ties, [0, 5, 0, 17, 100, 0], [width, 280, 150, 200, 201, 64], 40)
check("ties_one_value", torch.full((3, width), 2.5), [0, 3, 1], [width, 250, 129], 100)
check("ties_fill_k_exactly", torch.cat((torch.ones(2, 50), torch.zeros(2, 251)), 1), [0, 0], [width, 200], 50)
short = torch.randn(5, width, generator=gen)
check("windows_shorter_than_k", short, [0, 10, 250, 300, 301], [width, 200, 51, 1, 0], width + 9)
check("window_equal_to_k", short[:3], [0, 7, 1], [128, 128, 129], 128)
check("all_empty", short[:3], [0, 301, 12], [0, 0, 0], 16)
check("k_one", short[2:], [0, 4, 9], [width, 100, 1], 1)
check("all_minus_inf", torch.full((3, width), float("-inf")), [0, 20, 7], [width, 200, 100], 70)
check("all_minus_inf_few_kept", torch.full((3, width), float("-inf")), [0, 20, 7], [width, 200, 100], 20)
some_inf = torch.randn(3, width, generator=gen).masked_fill(torch.rand(3, width, generator=gen) < 0.6, float("-inf"))
check("many_minus_inf", some_inf, [0, 1, 0], [width, 299, 290], 150)
signed = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -0.0, 0.0, float("-inf")]).repeat(4, 40)
check("signed_zeros_and_inf", signed, [0, 3, 1, 0], [320, 310, 300, 320], 100)
tiny = torch.randn(4, width, generator=gen) * 1e-40
check("subnormals", tiny, [0, 1, 2, 3], [width, 290, 280, 270], 33)
check("empty_batch", torch.randn(0, width), [], [], 8)
check("bf16_logits", torch.randn(4, width, generator=gen).to(torch.bfloat16), [0, 3, 0, 30], [width, 250, 30, 200], 61)
wide = torch.randn(4, width + 7, generator=gen)
check("column_slice_view", wide[:, 3:3 + width], [0, 2, 150, 0], [width, 297, 151, 40], 37)
check("transposed_view", torch.randn(width, 3, generator=gen).t(), [0, 1, 5], [width, 250, 200], 45)
check("long_row_odd_width", torch.randn(3, 10007, generator=gen), [0, 5, 4000], [10007, 9001, 6007], 512)
table = torch.randperm(5000, generator=gen)[:3 * 700].view(3, 700).to(torch.int32)
check("rows_through_strided_table", ties[:3], [0, 4, 100], [width, 150, 200], 40, table[:, ::2])
"""

EDGE_CASES = ("ties_across_kth", "ties_one_value", "ties_fill_k_exactly", "windows_shorter_than_k", "window_equal_to_k",
              "all_empty", "k_one", "all_minus_inf", "all_minus_inf_few_kept", "many_minus_inf", "signed_zeros_and_inf", "subnormals",
              "empty_batch", "bf16_logits", "column_slice_view", "transposed_view", "long_row_odd_width",
              "rows_through_strided_table")


def test_indexer_topk_matches_the_reference_in_the_interpreter():
    from deepinfer.hal.spec import SPECS

    importlib.import_module("deepinfer.hal.ops")  # declares every OpSpec

    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [case.name for case in SPECS["indexer_topk"].cases]
    small = [f"{case.name}_small_blocks" for case in SPECS["indexer_topk"].cases if case.size != "real"]
    expected = [f"{name} ok" for name in cases + small + list(EDGE_CASES)]
    assert done.stdout.splitlines() == expected


@pytest.mark.parametrize("dtype,table", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_indexer_topk_kernel_compiles_for_hopper(dtype, table):
    from deepinfer_backends.sm100.fused import indexer_topk as kernel_module

    constants = dict(HAS_TABLE=table, BLOCK=kernel_module.BLOCK, CANDIDATES=kernel_module.CANDIDATES,
                     RADIX_BITS=kernel_module.RADIX_BITS)
    signature = dict(logits=f"*{dtype}", starts="*i64", lengths="*i64", out="*i32", scratch="*i32",
                     row_table="*i32", tokens="i32", row_stride="i32", table_stride="i32", extent="i32", k="i32")
    assert hopper_cubin(kernel_module.indexer_topk_kernel, signature, constants, num_warps=kernel_module.NUM_WARPS), \
        "no cubin"

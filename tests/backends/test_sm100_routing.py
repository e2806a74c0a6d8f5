"""The sm100 routing kernels (``moe_gate``, one-rank ``ep_dispatch``, ``moe_route``) against the reference, run by
Triton's interpreter on the CPU in a subprocess, on every OpSpec case and on edge cases (ties,
padding, empty batches, block and column-split boundaries); and each kernel compiled for sm_90."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.backends.triton_cubin import hopper_cubin

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = r"""
import torch
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.backend import UnsupportedInput
from deepinfer.hal.ops import all_to_all, routing as reference
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100 import ep_combine, routing
from deepinfer_backends.sm100.fused import ep_dispatch as kernels

INF, NAN = float("inf"), float("nan")


def check(op, name, inputs, tol_dtype=torch.float32):
    spec = SPECS[op]
    got = getattr(routing, op)(**inputs)
    want = spec.reference(**inputs)
    failures = compare(got, want, spec.tolerance(tol_dtype), f"{op}/{name}")
    assert not failures, failures
    if op == "ep_dispatch" and inputs["topk_ids"].numel():
        (rows, _, handle), (want_rows, _, want_handle) = got, want
        assert handle.routed.dtype == torch.bool and handle.expert_order.dtype == torch.int64
        assert torch.equal(handle.row_of_pair[handle.pair_index], torch.arange(handle.pair_index.numel()))
        y = (rows.float() * 1.5 - 0.25).to(rows.dtype)
        combined = ep_combine.ep_combine(y, handle)
        expected = all_to_all.ep_combine((want_rows.float() * 1.5 - 0.25).to(rows.dtype), want_handle)
        failures = compare(combined, expected, spec.tolerance(tol_dtype), f"ep_combine/{name}")
        assert not failures, failures
    print(op, name, "ok", flush=True)


def gate(logits, bias=None, top_k=2, routed_scale=1.5):
    return {"logits": logits, "bias": bias, "top_k": top_k, "routed_scale": routed_scale}


def gate_cases(gen):
    yield "e512_k16", gate(2 * torch.randn(9, 512, generator=gen), 0.1 * torch.randn(512, generator=gen), 16, 2.5)
    yield "e300_odd", gate(2 * torch.randn(33, 300, generator=gen), 0.1 * torch.randn(300, generator=gen), 6)
    yield "e1_k1", gate(torch.randn(3, 1, generator=gen), None, 1)
    yield "empty", gate(torch.randn(0, 8, generator=gen), torch.randn(8, generator=gen), 2)
    yield "bf16", gate((2 * torch.randn(7, 256, generator=gen)).bfloat16(),
                       (0.1 * torch.randn(256, generator=gen)).bfloat16(), 8)
    yield "ties_with_bias", gate(torch.randint(-1, 2, (20, 64), generator=gen).float(),
                                 0.5 * torch.randint(-1, 2, (64,), generator=gen).float(), 8)
    yield "all_equal", gate(torch.zeros(5, 384), None, 6)
    edges = torch.tensor([[19.99, 20.0, 20.01, 30.0, -30.0, -INF, 88.0, 100.0],
                          [-INF, -INF, -INF, -INF, -INF, -INF, -INF, -INF],
                          [1.0, NAN, 3.0, NAN, -1e-8, 1e-8, INF, -200.0]])
    yield "softplus_edges", gate(edges, None, 8)
    yield "signed_zero_ties", gate(torch.full((2, 8), -INF), torch.tensor([-0.0, 0.0] * 4), 5)
    wide = 2 * torch.randn(6, 400, generator=gen)
    yield "row_stride", gate(wide[:, 10:266], 0.1 * torch.randn(256, generator=gen), 6)
    yield "column_stride", gate(wide.t()[:64, :6].t(), None, 3)


def dispatch(tokens, hidden, top_k, num_experts, gen, unrouted=0.0, dtype=torch.float32, weight_dtype=torch.float32):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    ids[torch.rand(tokens, top_k, generator=gen) < unrouted] = -1
    weights = torch.rand(tokens, top_k, generator=gen).to(weight_dtype)
    return {"x": x, "topk_ids": ids, "topk_weights": weights, "num_experts": num_experts}


def dispatch_cases(gen):
    yield "decode_one", dispatch(1, 16, 1, 4, gen), torch.float32
    yield "empty", dispatch(0, 16, 6, 8, gen), torch.float32
    yield "no_slots", dispatch(3, 16, 0, 8, gen), torch.float32
    yield "all_unrouted", dispatch(5, 8, 3, 6, gen, unrouted=1.0), torch.float32
    yield "blocks_heavy_ties", dispatch(300, 40, 6, 5, gen, unrouted=0.2), torch.float32
    yield "prefill_like", dispatch(256, 64, 6, 384, gen, unrouted=0.05), torch.float32
    yield "e512", dispatch(70, 24, 8, 512, gen, unrouted=0.1), torch.float32
    yield "e1024", dispatch(40, 8, 4, 1024, gen), torch.float32
    yield "column_splits_bf16", dispatch(3, 1500, 2, 6, gen, dtype=torch.bfloat16,
                                         weight_dtype=torch.bfloat16), torch.bfloat16
    yield "hidden_zero", dispatch(4, 0, 2, 4, gen), torch.float32
    strided = dispatch(9, 48, 3, 7, gen, unrouted=0.3)
    strided["x"] = torch.randn(9, 80, generator=gen)[:, 5:53]
    strided["topk_ids"] = torch.randint(-1, 7, (3, 9), generator=gen).t()
    strided["topk_weights"] = torch.rand(3, 9, generator=gen).t()
    yield "strided", strided, torch.float32


def route(tokens, hidden, experts, top_k, gen, bias=True, dtype=torch.bfloat16):
    return {"x": torch.randn(tokens, hidden, generator=gen).to(dtype),
            "logits": 2 * torch.randn(tokens, experts, generator=gen),
            "bias": 0.1 * torch.randn(experts, generator=gen) if bias else None, "top_k": top_k, "routed_scale": 2.5}


for op in ("moe_gate", "ep_dispatch", "moe_route"):
    spec = SPECS[op]
    for case in spec.cases:
        check(op, case.name, case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu")), case.dtype)
gen = torch.Generator().manual_seed(1)
for name, inputs in gate_cases(gen):
    check("moe_gate", name, inputs)
for name, inputs, dtype in dispatch_cases(gen):
    check("ep_dispatch", name, inputs, dtype)
check("moe_route", "no_bias_column_splits", route(3, 1500, 6, 2, gen, bias=False), torch.bfloat16)
check("moe_route", "one_token_e384", route(1, 64, 384, 8, gen, dtype=torch.float32))
check("moe_route", "sixty_four_pairs", route(16, 24, 16, 4, gen), torch.bfloat16)
check("moe_route", "sixty_five_pairs", route(13, 24, 32, 5, gen), torch.bfloat16)
tied = route(4, 32, 8, 3, gen)
tied["logits"] = torch.randint(-1, 2, (4, 8), generator=gen).float()
check("moe_route", "ties", tied, torch.bfloat16)
kernels.TARGET_PROGRAMS, kernels.TARGET_BLOCKS = 2, 4
check("ep_dispatch", "several_tiles_per_split", dispatch(20, 2400, 3, 9, gen, unrouted=0.1))
check("ep_dispatch", "several_chunks_per_block", dispatch(300, 24, 6, 5, gen, unrouted=0.2))
check("ep_dispatch", "several_chunks_per_block_e384", dispatch(256, 16, 6, 384, gen, unrouted=0.05))
kernels.ONE_BLOCK_PAIRS = 1 << 12  # one launch, which counts the keys of many chunks itself
check("ep_dispatch", "one_launch_many_chunks", dispatch(300, 24, 6, 5, gen, unrouted=0.2))
check("ep_dispatch", "one_launch_e384", dispatch(100, 16, 6, 384, gen, unrouted=0.05))
kernels.ONE_BLOCK_PAIRS = 0  # three launches even for one token
check("ep_dispatch", "three_launches_decode", dispatch(1, 16, 6, 16, gen))

for call, error in ((lambda: routing.moe_gate(torch.randn(2, 8), None, 9, 1.0), ValueError),
                    (lambda: routing.moe_gate(torch.randn(2, 2048), None, 2, 1.0), UnsupportedInput),
                    (lambda: routing.ep_dispatch(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32),
                                                 torch.ones(2, 1), 4), ValueError)):
    try:
        call()
    except error:
        continue
    raise AssertionError(f"expected {error.__name__}")
print("refusals ok")
"""


def test_routing_kernels_match_the_reference_in_the_interpreter():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6 + 4 + len(SPECS_ROUTE) + 5 + 11 + 14 + 3 + 1 and lines[-1] == "refusals ok", lines


SPECS_ROUTE = ("tiny", "tiny_bf16", "tiny_ties_bf16", "many_pairs_bf16", "v41_decode_bf16", "small_decode_bf16")


def _kernels():
    import triton
    from deepinfer_backends.sm100.fused import ep_dispatch, moe_gate, moe_route

    for logits, experts, top_k in (("*fp32", 384, 6), ("*bf16", 256, 8), ("*fp32", 512, 16)):
        block_e = triton.next_power_of_2(experts)
        yield f"moe_gate_kernel[{logits[1:]},E{experts},k{top_k}]", moe_gate.moe_gate_kernel, dict(
            logits=logits, bias="*fp32", weights="*fp32", ids="*i64", tokens="i32", experts="i32", row_stride="i32",
            routed_scale="fp32"), dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=True,
                                       BLOCK_T=moe_gate.block_tokens(block_e),
                                       BLOCK_E=block_e, LIBDEVICE=True)
    for bins, block in ((32, 16), (512, 8), (512, ep_dispatch.MAX_BLOCK_PAIRS), (1024, 4)):
        yield f"dispatch_count_kernel[{bins},{block}]", ep_dispatch.dispatch_count_kernel, dict(
            topk_ids="*i64", counts="*i32", pairs="i32", num_experts="i32"), dict(BLOCK_PAIRS=block, BINS=bins)
        for one_block in (False, True) if block <= ep_dispatch.ONE_BLOCK_PAIRS else (False,):
            yield f"dispatch_place_kernel[{bins},{block},one_block={one_block}]", ep_dispatch.dispatch_place_kernel, \
                dict(x="*bf16", topk_ids="*i64", topk_weights="*fp32", starts="*i32", totals="*i32",
                     group_sizes="*i64", expanded="*bf16", pair_index="*i64", pair_weights="*fp32", routed="*i8",
                     expert_order="*i64", row_of_pair="*i64", pairs="i32", top_k="i32", num_experts="i32",
                     hidden="i32", x_stride="i32", split_cols="i32"), \
                dict(BLOCK_PAIRS=block, ROWS=ep_dispatch.place_rows(bins), BINS=bins, BLOCK_H=ep_dispatch.BLOCK_H,
                     ONE_BLOCK=one_block)
    for experts, top_k in ((16, 6), (384, 6), (1024, 8)):
        bins, block_e = ep_dispatch.bin_count(experts), triton.next_power_of_2(experts)
        yield f"moe_route_kernel[E{experts},k{top_k}]", moe_route.moe_route_kernel, dict(
            x="*bf16", logits="*fp32", bias="*fp32", weights="*fp32", ids="*i64", picked_ids="*i64",
            picked_weights="*fp32", group_sizes="*i64", expanded="*bf16", pair_index="*i64", pair_weights="*fp32",
            routed="*i8", expert_order="*i64", row_of_pair="*i64", tokens="i32", experts="i32", logits_stride="i32",
            routed_scale="fp32", hidden="i32", x_stride="i32", split_cols="i32"), dict(
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=True, GATE_T=moe_gate.block_tokens(block_e),
            BLOCK_E=block_e, LIBDEVICE=True, BLOCK_PAIRS=ep_dispatch.ONE_BLOCK_PAIRS, ROWS=ep_dispatch.place_rows(bins),
            BINS=bins, BLOCK_H=ep_dispatch.BLOCK_H)
    for bins in (512, 1024):
        yield f"dispatch_scan_kernel[{bins}]", ep_dispatch.dispatch_scan_kernel, dict(
            counts="*i32", starts="*i32", totals="*i32", group_sizes="*i64", blocks="i32", num_experts="i32"), \
            dict(BINS=bins, SCAN_ROWS=ep_dispatch.SCAN_ROWS, SCAN_BINS=ep_dispatch.SCAN_BINS)


KERNELS = list(_kernels()) if importlib.util.find_spec("triton") else []


@pytest.mark.parametrize("name,kernel,signature,constants", KERNELS, ids=[k[0] for k in KERNELS])
def test_routing_kernel_compiles_for_hopper(name, kernel, signature, constants):
    assert hopper_cubin(kernel, signature, constants), f"{name}: no cubin"

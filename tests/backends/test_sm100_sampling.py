"""The sm100 ``sample`` and ``speculative_accept`` kernels against the reference, run by Triton's
interpreter on the CPU (a subprocess: the interpreter is chosen when triton is imported): every
OpSpec case but the real-size ones (those run on a GPU), edge cases (ties at the k-th value, within a block and across blocks, top-p landing
exactly on a token's preceding mass, grammar-masked rows, greedy rows beside sampled ones, seeds
>= 2**63, the draft namespace, odd vocabulary sizes; the filter cases in both filter orders), and
``draw_uniform`` bit for bit (every case, both namespaces); then each kernel compiled for sm_90
(Hopper) to a cubin, in both filter orders, no GPU needed."""
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.backends.triton_cubin import hopper_cubin

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = '''
import math
import sys
import torch
import triton
import triton.language as tl
import deepinfer.hal.ops  # noqa: F401
from deepinfer.hal.ops.sampling import SEED_NAMESPACE_DRAFT, as_int64, draw_uniform
from deepinfer.hal.spec import SPECS, compare
from deepinfer_backends.sm100 import sampling
from deepinfer_backends.sm100.fused.sampling import draw_uniform as device_uniform

device = torch.device(sys.argv[1])
gen = torch.Generator().manual_seed(0)


@triton.jit
def uniform_kernel(seeds, positions, out, n, CASE: tl.constexpr, NAMESPACE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    inside = i < n
    tl.store(out + i, device_uniform(tl.load(seeds + i, mask=inside), tl.load(positions + i, mask=inside), CASE,
                                     NAMESPACE), mask=inside)


seeds = torch.cat([torch.randint(-(1 << 63), (1 << 63) - 1, (500,), generator=gen),
                   torch.tensor([0, -1, -(1 << 63), (1 << 63) - 1, as_int64(2**64 - 1_000_000_007)])])
positions = torch.cat([torch.randint(0, 1 << 40, (500,), generator=gen), torch.tensor([0, 1, 10000019, 3 << 40, -1])])
for namespace in (0, SEED_NAMESPACE_DRAFT, 2**64 - 1):
    for case in (0, 1, 2):
        out = torch.empty(len(seeds), dtype=torch.float64, device=device)
        uniform_kernel[(1,)](seeds.to(device), positions.to(device), out, len(seeds), CASE=case, NAMESPACE=namespace,
                             BLOCK=1024)
        want = draw_uniform(seeds + as_int64(namespace), positions, case)
        assert torch.equal(out.cpu(), want), (namespace, case, (out.cpu() != want).sum())
print("draw_uniform ok")


def sample_case(rows, vocab, temperature, top_p, top_k, logits=None, **options):
    logits = 2 * torch.randn(rows, vocab, generator=gen) if logits is None else logits
    return dict(logits=logits, temperature=torch.tensor(temperature), top_p=torch.tensor(top_p),
                top_k=torch.tensor(top_k, dtype=torch.int64), seeds=torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), generator=gen),
                positions=torch.randint(0, 1 << 30, (rows,), generator=gen), **options)


def masked(rows, vocab, allowed):
    logits = 3 * torch.randn(rows, vocab, generator=gen)
    keep = torch.rand(rows, vocab, generator=gen) < allowed
    keep[:, 0] = True
    return logits.masked_fill(~keep, float("-inf"))


ties = torch.randint(0, 3, (6, 2500), generator=gen).float()
ties_wide = torch.randint(0, 3, (6, 20000), generator=gen).float()
signed_zeros = torch.tensor([[0.0, -0.0, -1.0, 1.0, -0.0, 0.0, 2.0, -2.0]] * 4)
powers_of_two = torch.full((3, 3000), float("-inf"))
powers_of_two[:, 1000:1004] = torch.tensor([math.log(4), math.log(2), 0.0, 0.0])
one_left = torch.full((3, 3000), float("-inf"))
one_left[torch.arange(3), torch.tensor([0, 1777, 2999])] = 0.5
V = 2049
EDGES = {
    "top_k_1_and_all": sample_case(6, V, [1.0] * 6, [1.0] * 6, [1, V, V - 1, V + 5, 2, 1]),
    "top_p_tiny_and_near_one": sample_case(5, V, [1.0, 0.5, 3.0, 1.0, 1.0], [1e-7, 1e-3, 0.999999, 0.99, 1.0],
                                           [0, 0, 0, 40, 0]),
    "ties_at_the_kth_value": sample_case(6, 2500, [1.0, 1.0, 0.5, 1.0, 0.0, 2.0], [1.0, 0.7, 1.0, 0.4, 1.0, 0.9],
                                         [1, 3, 800, 1700, 2, 2], logits=ties),
    "signed_zeros": sample_case(4, 8, [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.9], [3, 4, 0, 6], logits=signed_zeros),
    "top_p_reached_exactly": sample_case(3, 3000, [1.0] * 3, [0.5, 0.75, 0.875], [0] * 3, logits=powers_of_two),
    "grammar_masked": sample_case(6, 17000, [1.0, 0.8, 1.0, 0.0, 1.0, 1.5], [1.0, 0.9, 1.0, 1.0, 0.5, 1.0],
                                  [0, 0, 500, 0, 10, 3], logits=masked(6, 17000, 0.05)),
    "all_masked_but_one": sample_case(3, 3000, [1.0, 0.0, 1.0], [0.9, 1.0, 1.0], [5, 0, 0], logits=one_left),
    "greedy_beside_sampled": sample_case(6, 5000, [0.0, 1.0, 0.0, 1e-6, 0.0, 0.7], [1.0, 1.0, 0.3, 1.0, 1.0, 0.9],
                                         [0, 0, 7, 0, 1, 0]),
    "greedy_first_of_tied_maxima": sample_case(4, 20000, [0.0] * 4, [1.0] * 4, [0] * 4,
                                               logits=torch.randint(0, 2, (4, 20000), generator=gen).float()),
    "draft_namespace_resample": sample_case(4, V, [1.0, 0.6, 1.0, 0.0], [0.9, 1.0, 1.0, 1.0], [0, 0, 30, 0],
                                            namespace=SEED_NAMESPACE_DRAFT, case=1),
    "filters_off": sample_case(4, V, [1.0, 0.0, 2.0, 0.0], [1.0, 0.5, 1.0, 1.0], [0, 3, 0, 0], filters=False),
    "flat_long_search": sample_case(3, 9000, [4.0, 2.0, 1.0], [0.95, 0.5, 0.999], [0, 7000, 0]),
    "one_token": sample_case(2, 1, [1.0, 0.0], [0.5, 1.0], [1, 0]),
    "bf16_logits_f64_temperature": {**sample_case(3, V, [1.0, 0.5, 0.0], [0.9, 1.0, 1.0], [0, 20, 0]),
                                    "logits": (2 * torch.randn(3, V, generator=gen)).bfloat16(),
                                    "temperature": torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)},
    "no_rows": sample_case(0, V, [], [], []),
    "ties_across_blocks": sample_case(6, 20000, [1.0, 1.0, 0.5, 1.0, 2.0, 1.0], [1.0, 0.6, 1.0, 0.3, 0.9, 0.45],
                                      [9000, 15000, 1, 0, 4000, 12000], logits=ties_wide),
    "top_k_and_top_p": sample_case(5, 9000, [1.0, 0.7, 1.5, 1.0, 1.0], [0.5, 0.9, 0.3, 0.99, 0.6],
                                   [5, 100, 2, 3000, 8999]),
}
for name in ("ties_at_the_kth_value", "top_p_reached_exactly", "grammar_masked", "flat_long_search",
             "ties_across_blocks", "top_k_and_top_p"):
    EDGES[f"{name}_vllm_order"] = {**EDGES[name], "filter_order": "vllm"}


def speculative_case(rows, vocab, target, draft, ids):
    return dict(target_logprobs=target, draft_logprobs=draft, draft_ids=torch.tensor(ids, dtype=torch.int64),
                seeds=torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), generator=gen),
                positions=torch.randint(0, 1 << 30, (rows,), generator=gen))


target = torch.log_softmax(2 * torch.randn(5, 3001, generator=gen), dim=-1)
draft = torch.log_softmax(2 * torch.randn(5, 3001, generator=gen), dim=-1)
draft_masked = draft.clone()
draft_masked[:, :1500] = float("-inf")
target_masked = target.clone()
target_masked[:, :1500] = float("-inf")
SPECULATIVE_EDGES = {
    "odd_vocab_no_draft": speculative_case(5, 3001, target, draft, [-1, 0, 3000, 17, -1]),
    "draft_token_impossible": speculative_case(5, 3001, target, draft_masked, [3, 1499, 2000, 0, 10]),
    "empty_residual": speculative_case(5, 3001, draft - 1.0, draft, [3, 4, 5, -1, 7]),
    "draft_token_impossible_under_both": speculative_case(5, 3001, target_masked, draft_masked, [3, 1499, 2000, 0, 10]),
    "no_rows": speculative_case(0, 3001, target[:0], draft[:0], []),
}

for op, edges in (("speculative_accept", SPECULATIVE_EDGES), ("sample", EDGES)):
    spec = SPECS[op]
    cases = [(case.name, case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))) for case in spec.cases
             if device.type != "cpu" or case.size != "real"]  # real sizes: minutes in the interpreter
    for name, inputs in cases + list(edges.items()):
        got = getattr(sampling, op)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        failures = compare(got, spec.reference(**inputs), spec.tolerance(torch.float32), name)
        assert not failures, failures
        print(op, name, "ok")
'''


def test_sampling_kernels_match_the_reference_in_the_interpreter(tmp_path):
    from deepinfer.hal.spec import SPECS

    importlib.import_module("deepinfer.hal.ops")  # declares every OpSpec
    script = tmp_path / "check_sm100_sampling.py"
    script.write_text(CHECK)
    done = subprocess.run([sys.executable, str(script), "cpu"], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "draw_uniform ok"
    spec_cases = [f"{op} {case.name} ok" for op in ("speculative_accept", "sample") for case in SPECS[op].cases
                  if case.size != "real"]
    assert set(spec_cases) <= set(lines) and len(lines) == 1 + len(spec_cases) + 5 + 23, lines
    assert all(line.endswith(" ok") for line in lines), lines


def _kernels():
    from deepinfer_backends.sm100.fused import sampling, speculative

    rows = dict(seeds="*i64", positions="*i64", vocab="i32")
    for filters, order in ((True, "deepinfer"), (True, "vllm"), (False, "deepinfer")):
        yield f"sample_kernel[filters={filters}, {order} order]", sampling.sample_kernel, dict(
            logits="*bf16", temperature="*fp32", top_p="*fp32", top_k="*i64", token_ids="*i64", logprobs="*fp32",
            logits_stride="i32", **rows), \
            dict(CASE=0, NAMESPACE=1_000_000_007, FILTERS=filters, DEEPINFER=order == "deepinfer",
                 BLOCK=sampling.BLOCK_VOCAB), sampling.NUM_WARPS
    yield "speculative_kernel", speculative.speculative_kernel, dict(
        target="*fp32", draft="*fp32", draft_ids="*i64", accepted="*u8", resampled="*i64", target_stride="i32",
        draft_stride="i32", **rows), dict(BLOCK=speculative.BLOCK_VOCAB), speculative.NUM_WARPS


KERNELS = list(_kernels()) if importlib.util.find_spec("triton") else []


@pytest.mark.parametrize("name,kernel,signature,constants,num_warps", KERNELS, ids=[k[0] for k in KERNELS])
def test_sampling_kernel_compiles_for_hopper(name, kernel, signature, constants, num_warps):
    assert hopper_cubin(kernel, signature, constants, num_warps=num_warps, enable_fp_fusion=False), f"{name}: no cubin"

"""The sm100 batch-invariant table on a GPU (skipped without one, or without tilelang): each row's
bits alone and anywhere in a larger, shuffled batch; a grouped-GEMM row in any segment; a token's
bits through the prefill kernel (with ``main_keys``) and the decode kernel."""
import importlib.util

import pytest
import torch

from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.formats import decode_tokens
from tests.hal.oracle import _clone
from tests.hal.test_batch_invariance import PER_SEQUENCE_KEYS, ROW_ARGS, _outputs, _row_count, _rows
from deepinfer.hal.parity import to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                                  reason="the sm100 backend needs tilelang")]
CUDA = torch.device("cuda")
ROWS = 300
"""Rows of the shuffled batch: more than one 256-row tile of the reference fallback and many GEMM tiles."""


def _table(mla: str = "auto"):
    from deepinfer_backends.sm100 import INVARIANT

    return INVARIANT, get_backend("sm100", {"mla_kernel": mla}).implementations(batch_invariant=True)


def _bf16_cases(op: str) -> list[str]:
    """The op's tiny bf16 cases whose rows stand alone (not per-sequence keys, whose rows pair
    with their sequence's key list)."""
    return [c.name for c in SPECS[op].cases if c.dtype == torch.bfloat16 and c.size == "tiny"
            and c.name not in PER_SEQUENCE_KEYS]


def _inputs(op: str, case: str) -> dict:
    inputs = SPECS[op].case(case).make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    return to_device(inputs, CUDA)


EXTRA_ROW_ARGS = {"apply_rope": ("x", "positions"), "kv_load": ("slots",), "swiglu": ("gate", "up")}
"""Row arguments of ops the reference serves as they are in its batch-invariant table."""
MLA_KERNELS = ("portable", "warp_specialized")
"""The sparse MLA kernels on Hopper (``backend.options.mla_kernel``)."""


@pytest.mark.parametrize("op,case,mla", [(op, case, mla) for op in ("linear", "rms_norm", "indexer_logits",
                                                                    "kv_norm_rope_store", "mla_sparse_decode",
                                                                    "mla_sparse_prefill", "mhc_mixes", "mhc_head",
                                                                    "mhc_pre", "mhc_post", "apply_rope", "kv_load",
                                                                    "swiglu")
                                         for case in _bf16_cases(op)
                                         for mla in (MLA_KERNELS if op.startswith("mla") else ["portable"])])
def test_each_row_has_the_same_bits_alone_and_anywhere_in_a_larger_batch(op, case, mla):
    impl = _table(mla)[1][op]
    inputs = _inputs(op, case)
    rows = [name for name in {**ROW_ARGS, **EXTRA_ROW_ARGS}[op] if inputs.get(name) is not None]
    count = _row_count(inputs[rows[0]])
    order = (torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)) % count).to(CUDA)
    batched = _outputs(impl(**{**_clone(inputs), **{n: _rows(inputs[n], order) for n in rows}}))
    for i in range(count):
        alone = _outputs(impl(**{**_clone(inputs), **{n: _rows(inputs[n], torch.tensor([i], device=CUDA))
                                                        for n in rows}}))
        for where in (order == i).nonzero()[:, 0].tolist():
            for got, want in zip(batched, alone):
                assert torch.equal(got[where], want[0]), f"{op}/{case}: row {i} differs at batch position {where}"


@pytest.mark.parametrize("case", _bf16_cases("grouped_gemm"))
def test_grouped_gemm_row_does_not_depend_on_its_segment(case):
    impl = _table()[1]["grouped_gemm"]
    inputs = _inputs("grouped_gemm", case)
    x, weight, sizes = inputs["x"], inputs["weight"], inputs["group_sizes"]
    experts = sizes.numel()
    expert_of = torch.repeat_interleave(torch.arange(experts, device=CUDA), sizes)
    grown = torch.cat([(expert_of == e).nonzero()[:, 0].repeat(40) for e in range(experts)])
    batched = impl(_rows(x, grown), weight, 40 * sizes)
    for where, row in enumerate(grown.tolist()[::7]):
        alone = impl(_rows(x, torch.tensor([row], device=CUDA)), weight,
                     torch.nn.functional.one_hot(expert_of[row], experts))
        assert torch.equal(batched[where * 7], alone[0]), f"{case}: row {row} differs at position {where * 7}"


@pytest.mark.parametrize("mla", MLA_KERNELS)
def test_a_token_gets_the_same_bits_through_prefill_and_decode(mla):
    """Decode reads the fp8 main and fp4 extra caches; prefill reads the same decoded keys from a
    bf16 buffer, with ``main_keys`` marking where decode's main list ends."""
    table = _table(mla)[1]
    args = _inputs("mla_sparse_decode", "tiny_bf16_fp8_fp4")
    q, batch, s_q = args["q"], args["q"].shape[0], args["q"].shape[1]
    main = decode_tokens(args["cache"].reshape(-1, args["cache"].shape[-1]), args["cache_format"])
    extra = decode_tokens(args["extra_cache"].reshape(-1, args["extra_cache"].shape[-1]), args["extra_format"])
    indices = args["indices"].reshape(batch * s_q, -1)
    shifted = args["extra_indices"].reshape(batch * s_q, -1)
    shifted = torch.where(shifted >= 0, shifted + main.shape[0], shifted)
    assert indices.shape[1] % 32, "the case must leave the main list short of a whole key block"
    out, lse = table["mla_sparse_decode"](**args)
    prefill_out, prefill_lse = table["mla_sparse_prefill"](
        q.reshape(batch * s_q, *q.shape[2:]), torch.cat((main, extra)).to(torch.bfloat16),
        torch.cat((indices, shifted), dim=1), args["sink"], args["scale"], main_keys=indices.shape[1])
    assert torch.equal(prefill_out, out.reshape(prefill_out.shape))
    assert torch.equal(prefill_lse, lse.reshape(prefill_lse.shape))

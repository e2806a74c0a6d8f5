"""Both sparse MLA kernels against the reference on a GPU (skipped without one, or without
tilelang), over list lengths that stress the way they walk the keys in 32- and 64-key blocks: key
counts that end in a partial block, an odd number of blocks, an fp8 main list with no extra list,
lists shorter than one block, and rows split over the key list (the wrapper's choice for small
batches) or not. The reference runs on the CPU in float32 on the same (bf16-rounded) inputs."""
import importlib.util

import pytest
import torch

from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.ops.mla import _decode_case, _prefill_case
from deepinfer.hal.spec import compare
from tests.backends.test_sm100_gpu_invariance import MLA_KERNELS
from tests.hal.oracle import _clone
from deepinfer.hal.parity import to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                                  reason="the sm100 backend needs tilelang")]
DECODE = {  # name -> (rows b, s_q, heads, main keys, extra keys, main format)
    "fp8 20 keys": (2, 1, 64, 20, 0, "fp8"),
    "fp8 70 keys": (2, 2, 64, 70, 0, "fp8"),
    "fp8 33 + fp4 10 keys": (1, 2, 64, 33, 10, "fp8"),
    "fp8 96 + fp4 200 keys, h=128, 80 rows": (40, 2, 128, 96, 200, "fp8"),
    "bf16 90 keys": (3, 1, 64, 90, 0, "bf16"),
}
PREFILL = {  # name -> (tokens, heads, dim, buffer rows, keys)
    "d512 90 keys": (6, 64, 512, 300, 90),
    "d512 150 keys, h=128, 70 rows": (70, 128, 512, 500, 150),
    "d64 8 keys": (5, 64, 64, 40, 8),
}


def _check(op: str, make, mla: str) -> None:
    inputs = make(torch.Generator().manual_seed(0), torch.device("cpu"))
    for name in ("q", "kv"):
        if name in inputs:
            inputs[name] = inputs[name].to(torch.bfloat16)
    want = SPECS[op].reference(**{k: v.float() if k in ("q", "kv") else v for k, v in _clone(inputs).items()})
    impl = get_backend("sm100", {"mla_kernel": mla}).implementations()[op]
    got = impl(**to_device(_clone(inputs), torch.device("cuda")))
    failures = compare(got, want, SPECS[op].tolerance(torch.bfloat16), f"{op}/{mla}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mla", MLA_KERNELS)
@pytest.mark.parametrize("case", DECODE)
def test_decode_matches_the_reference_whatever_the_list_lengths(case, mla):
    b, s_q, heads, keys, extra_keys, fmt = DECODE[case]
    _check("mla_sparse_decode", _decode_case(b=b, s_q=s_q, h=heads, k=keys, cache_format=fmt, extra_k=extra_keys,
                                             padded=3), mla)


@pytest.mark.parametrize("mla", MLA_KERNELS)
@pytest.mark.parametrize("case", PREFILL)
def test_prefill_matches_the_reference_whatever_the_list_lengths(case, mla):
    tokens, heads, dim, rows, keys = PREFILL[case]
    _check("mla_sparse_prefill", _prefill_case(t=tokens, h=heads, d=dim, s=rows, k=keys, padded=5), mla)

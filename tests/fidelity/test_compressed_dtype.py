"""The compressor's output as DeepInfer 0.1.0 writes it (issue 29): bf16, whatever the dtype of
its inputs, the pooling itself done in float32 and rounded once."""
import torch

from deepinfer.hal import OpTable


def _compress(latent, score, ratio):
    tokens = latent.shape[0]
    return OpTable("reference").compress_tokens(latent, score, torch.arange(tokens), torch.zeros(tokens, dtype=torch.int64),
                                                torch.zeros(tokens, dtype=torch.int64),
                                                torch.zeros(1, 4, 2, latent.shape[1]), ratio)


def test_ratio_one_rounds_float32_latents_to_bf16():
    # 1 + 2^-10 lies below half of bf16's step 2^-7 at 1: it rounds to 1; 1 + 2^-7 is a bf16 value
    out, emit = _compress(torch.tensor([[1 + 2**-10, 1 + 2**-7]]), None, 1)
    assert out.dtype == torch.bfloat16 and emit.tolist() == [True]
    assert out.float().tolist() == [[1.0, 1 + 2**-7]]


def test_a_pooled_row_is_rounded_once_after_float32_pooling():
    # equal scores weigh the two members 1/2 each: pooling 1 and 1 + 2^-8 gives 1 + 2^-9 in float32,
    # below half of bf16's step 2^-7 at 1, so the row is 1
    latent = torch.tensor([[1.0], [1 + 2**-8]])
    out, emit = _compress(latent, torch.zeros(2, 1), 2)
    assert out.dtype == torch.bfloat16 and emit.tolist() == [False, True]
    assert out.float().tolist() == [[0.0], [1.0]]

"""Logits in float32 from bf16 weights (issue 29): DeepInfer's LM head and DSpark Markov head are
bf16 GEMMs that write their float32 accumulator, so two logits closer than bf16's step stay
apart. The expectations are worked by hand or in float64, never read off our ops."""
import pytest
import torch

from deepinfer.hal import OpTable
from deepinfer.hal.ops.grouped_gemm import linear
from deepinfer.hal.ops.stacked_linear import stacked_linear
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import init_random_weights
from tests.models.tiny_model import SequenceRunner, tiny_config

# x = [1, 1] against rows [8, 8] and [8, 8.0625] (all exact in bf16): 16 and 16.0625. bf16's step at
# 16 is 0.125, and 16.0625 lies half-way, so rounding to even gives 16: a tie that argmax breaks to 0.
X = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
W = torch.tensor([[8.0, 8.0], [8.0, 8.0625]], dtype=torch.bfloat16)


def test_float32_output_keeps_logits_closer_than_a_bf16_step():
    got = linear(X, W, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert got.tolist() == [[16.0, 16.0625]]
    assert got.argmax(dim=-1).item() == 1


def test_the_default_output_rounds_to_the_inputs_dtype():
    got = linear(X, W)
    assert got.dtype == torch.bfloat16 and got.tolist() == [[16.0, 16.0]]


def test_stacked_linear_writes_every_product_in_float32():
    first, second = stacked_linear(X, [W, W.flip(0)], out_dtype=torch.float32)
    assert first.tolist() == [[16.0, 16.0625]] and second.tolist() == [[16.0625, 16.0]]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_other_output_dtypes_are_refused(out_dtype):
    with pytest.raises(ValueError, match="out_dtype must be None .* or torch.float32"):
        linear(X, W, out_dtype=out_dtype)


@pytest.fixture(scope="module")
def bf16_model():
    model = DeepseekV41ForCausalLM(tiny_config(), OpTable("reference"), torch.bfloat16, max_model_len=256)
    return init_random_weights(model, seed=3)


def _float64_head(hidden: torch.Tensor, norm, head: torch.Tensor) -> torch.Tensor:
    """RMSNorm in float64, rounded to bf16 as the op hands it to the head, then the head in float64."""
    h = hidden.double()
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + norm.eps) * norm.weight.double()
    return normed.bfloat16().double() @ head.double().T


def test_the_model_head_matches_a_float64_head_without_bf16_rounding(bf16_model):
    hidden = torch.randn(6, bf16_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = bf16_model.logits(hidden, bf16_model.norm)
    want = _float64_head(hidden, bf16_model.norm, bf16_model.head.weight)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    assert (got != got.bfloat16().float()).float().mean() > 0.5  # most logits are not bf16 values


def test_decoded_logits_are_float32_values_not_bf16_ones(bf16_model):
    runner = SequenceRunner(bf16_model, num_seqs=2, max_len=64)
    runner.step({0: [5, 9, 14, 3], 1: [7, 7]})
    logits = runner.step({0: [11], 1: [2]}, decode=True)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits != logits.bfloat16().float()).float().mean() > 0.5


def test_the_markov_correction_is_the_float32_accumulator(bf16_model):
    if not bf16_model.mtp:
        pytest.skip("the tiny config has no DSpark draft layers")
    head = bf16_model.mtp[-1]
    previous = torch.tensor([1, 4, 9])
    embedded, correction = head.markov(previous)
    want = embedded.double() @ head.markov_head.head.weight.double().T
    assert correction.dtype == torch.float32
    assert torch.allclose(correction.double(), want, atol=1e-6, rtol=1e-5)

"""``model.expert_activation_format=fp8``: the experts' GEMMs, routed and shared, take FP8
activations (e4m3, UE8M0 per 32), the expert inputs and the SwiGLU's float32 products (a routed
expert's times its router weight) cast as DeepInfer's expert compute casts them, checked against
a float64 computation of the recipe; the option reaches every MoE layer from the config (random
weights and a checkpoint) and is refused where it cannot apply."""
import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import ConfigError, ModelConfig
from deepinfer.hal import OpTable
from deepinfer.hal.formats import cast_back
from deepinfer.models.deepseek_v41.moe import MoE, cast_expert_activations
from deepinfer.models.deepseek_v41.weights import hold_quantized, save_pretrained
from deepinfer.models.registry import build_model
from tests.models.tiny_model import tiny_model


def _moe(fmt: str | None) -> MoE:
    model = cast_expert_activations(hold_quantized(tiny_model(seed=5), "mxfp4"), fmt)
    return next(m for m in model.modules() if isinstance(m, MoE))


def _routing(moe: MoE, tokens: int):
    gen = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(moe.num_experts, generator=gen)[:moe.top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, moe.top_k, generator=gen) + 0.2
    return weights / weights.sum(-1, keepdim=True), ids


def _swiglu_fp8(rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
                weight: float = 1.0, weight_first: bool = True):
    """One expert by the recipe, in float64 from FP8-cast ``rows``: the clamped SwiGLU (rounded to
    float32, as the op hands it on) times the router ``weight`` in float32, cast through FP8, then
    the down projection. ``weight_first=False``: the weight multiplies the projection instead."""
    hidden = F.silu((rows @ w1.T).clamp(max=limit)) * (rows @ w3.T).clamp(-limit, limit)
    if not weight_first:
        return weight * (cast_back(hidden.float(), "fp8").double() @ w2.T)
    weighted = hidden.float() * torch.tensor(weight, dtype=torch.float32)
    return cast_back(weighted, "fp8").double() @ w2.T


def _experts_fp8_float64(moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         weight_first: bool = True) -> torch.Tensor:
    """The routed experts (weighted) plus the shared expert by the recipe, in float64."""
    w1, w3, w2 = (moe.experts.operand(name).dequantize().double() for name in ("w1", "w3", "w2"))
    shared = [getattr(moe.shared_experts, name).operand().dequantize().double() for name in ("w1", "w3", "w2")]
    rows = cast_back(x, "fp8").double()
    out = _swiglu_fp8(rows, *shared, moe.limit)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            out[t] += _swiglu_fp8(rows[t], w1[e], w3[e], w2[e], moe.limit, weight, weight_first)
    return out


def test_fp8_expert_activations_follow_the_recipe():
    fp8, plain = _moe("fp8"), _moe(None)
    x = torch.randn(24, fp8.gate.weight.shape[1], generator=torch.Generator().manual_seed(4))
    weights, ids = _routing(fp8, x.shape[0])
    want = _experts_fp8_float64(fp8, x, weights, ids)
    scale = want.abs().max().item()
    got_error = (fp8.apply_experts(x, weights, ids).double() - want).abs().max().item()
    plain_error = (plain.apply_experts(x, weights, ids).double() - want).abs().max().item()
    weight_last = _experts_fp8_float64(fp8, x, weights, ids, weight_first=False)
    assert got_error <= 1e-5 * scale, f"fp8 expert activations are {got_error / scale:.1e} of max |y| off the recipe"
    assert plain_error > 100 * got_error, "the model-dtype activations should miss the FP8 recipe"
    assert (weight_last - want).abs().max().item() > 100 * got_error, \
        "weighting after the down projection should miss the recipe"


def test_the_forward_casts_as_apply_experts_does():
    moe = _moe("fp8")
    x = torch.randn(10, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(6))
    weights, ids = moe.route(x)
    torch.testing.assert_close(moe(x), moe.apply_experts(x, weights, ids), rtol=0, atol=0)


def test_the_config_reaches_every_moe_layer_and_generation_runs():
    params = SamplingParams(max_tokens=6, temperature=0.0)
    llm = LLM("tiny_random", "reference", ["engine.use_tqdm=false", "model.weight_format=mxfp4",
                                           "model.expert_activation_format=fp8"])
    layers = [m for m in llm.model.modules() if isinstance(m, MoE)]
    assert layers and all(m.activation_format == "fp8" for m in layers)
    outputs = llm.generate([[1, 5, 9, 200, 17], [3, 4]], params)
    assert [len(o.token_ids) for o in outputs] == [6, 6]


def test_a_checkpoint_loads_with_fp8_expert_activations_in_every_moe_layer(tmp_path):
    save_pretrained(tiny_model(seed=5), tmp_path)
    config = ModelConfig(checkpoint=str(tmp_path), weight_format="mxfp4", expert_activation_format="fp8")
    model, random_weights = build_model(config, OpTable("reference"))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert not random_weights and layers and all(m.activation_format == "fp8" for m in layers)
    assert all(m.experts.w1_scale is not None for m in layers)


@pytest.mark.parametrize("fields, match", [
    (dict(expert_activation_format="fp8"), "set model.weight_format"),
    (dict(expert_activation_format="int8", weight_format="fp8"), "model.expert_activation_format='int8'"),
])
def test_the_config_refuses_what_cannot_apply(fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**fields)


def test_plain_experts_refuse_fp8_activations():
    with pytest.raises(ValueError, match="hold the experts quantized"):
        cast_expert_activations(tiny_model(seed=5), "fp8")

"""V4.1 MoE: sqrt-softplus gate with noaux_tc bias, routed SwiGLU experts (clamped) through EP
dispatch, grouped GEMMs and combine, plus one always-on shared expert."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer.hal.registry import OpTable
from deepinfer.models.layers import Linear, quantized_operand, quantized_parameters, stacked

EXPERT_ACTIVATION_FORMATS = (None, "fp8")
"""What the experts' GEMMs take as activations (:meth:`MoE.cast_activations`)."""


class Gate(nn.Module):
    """Router: ``weight [E, H]`` (logits in float32) and the noaux_tc selection ``bias [E]``."""

    def __init__(self, hidden: int, experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False)


class Experts(nn.Module):
    """Routed experts stacked per projection: ``w1, w3 [E, I, H]``, ``w2 [E, H, I]``, plain, or
    after :meth:`hold_quantized` e4m3 / packed e2m1 data with ``w1_scale`` etc. (UE8M0 per 32).

    Checkpoints name them one by one (``experts.{e}.w1.weight``); see ``model.official_state_dict``."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, experts: int, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(experts, intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        for name in self.PROJECTIONS:
            self.register_parameter(f"{name}_scale", None)

    def hold_quantized(self, fmt: str) -> None:
        """Keep every projection as ``fmt`` (``"fp8"`` or ``"mxfp4"``), encoded from its current values."""
        for name in self.PROJECTIONS:
            data, scale = quantized_parameters(getattr(self, name), fmt)
            setattr(self, name, data)
            setattr(self, f"{name}_scale", scale)

    def operand(self, name: str):
        """Projection ``name`` as the grouped GEMM takes it (plain or Quantized)."""
        return quantized_operand(getattr(self, name), getattr(self, f"{name}_scale"))


class SharedExperts(nn.Module):
    """The shared expert(s) as one SwiGLU MLP of width ``width``."""

    def __init__(self, hidden: int, width: int, ops: OpTable, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(hidden, width, ops, dtype)
        self.w3 = Linear(hidden, width, ops, dtype)
        self.w2 = Linear(width, hidden, ops, dtype)


class MoE(nn.Module):
    """Token-choice MoE; ``ep_group`` (a process group or None) spreads the experts over ranks."""

    def __init__(self, hidden: int, experts: int, top_k: int, intermediate: int, shared_width: int,
                 routed_scale: float, swiglu_limit: float, ops: OpTable, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.top_k, self.routed_scale, self.limit = experts, top_k, routed_scale, swiglu_limit
        self.ops = ops
        self.ep_group = None
        self.eplb = None  # an ExpertMap (deepinfer.parallel.expert) under EPLB: logical to physical experts
        self.gate = Gate(hidden, experts, dtype)
        self.experts = Experts(experts, hidden, intermediate, dtype)
        self.shared_experts = SharedExperts(hidden, shared_width, ops, dtype)
        self.activation_format = None  # "fp8": the experts' GEMMs take FP8 activations (cast_activations)

    def cast_activations(self, fmt: str | None) -> None:
        """Feed the experts' GEMMs (routed and shared) activations in ``fmt``: None, the model dtype;
        ``"fp8"``, e4m3 with UE8M0 scales per 32 (``quantize_activations``), as DeepInfer's expert
        compute takes them: the expert inputs, and the SwiGLU's float32 products ahead of the down
        projections. ``"fp8"`` needs the experts held quantized (``model.weight_format``)."""
        if fmt not in EXPERT_ACTIVATION_FORMATS:
            raise ValueError(f"expert activations are one of {list(EXPERT_ACTIVATION_FORMATS)}, got {fmt!r}")
        shared = self.shared_experts
        if fmt is not None and any(w is None for w in (self.experts.w1_scale, shared.w1.weight_scale,
                                                        shared.w3.weight_scale, shared.w2.weight_scale)):
            raise ValueError(f"{fmt} expert activations feed block-scaled expert GEMMs: hold the experts quantized "
                             f"(model.weight_format=fp8 or mxfp4), or keep model.expert_activation_format=null")
        self.activation_format = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts plus the shared expert on the normalised ``x``: the router's logits and
        the shared expert's activation (the SwiGLU of its gate and up projections) in one
        ``stacked_linear`` (with FP8 activations the shared expert apart, on the cast ``x``), then
        the gate with the dispatch in one ``moe_route``."""
        if self.activation_format is not None:
            return self._routed(x, self._shared_cast(x), logits=self.ops.linear(x, self.gate.weight))
        shared = self.shared_experts
        logits, activation = stacked(self.ops, x, [self.gate.weight, shared.w1, shared.w3], swiglu=True,
                                     swiglu_limit=self.limit)
        return self._routed(x, shared.w2(activation), logits=logits)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights float32 [T, k], expert ids int64 [T, k])`` of the gate (``moe_gate`` reads the
        logits in float32)."""
        return self._select(self.ops.linear(x, self.gate.weight))

    def apply_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts (weighted by ``weights``) plus the shared expert."""
        if self.activation_format is not None:
            return self._routed(x, self._shared_cast(x), weights=weights, ids=ids)
        shared = self.shared_experts
        gate, up = stacked(self.ops, x, [shared.w1, shared.w3])
        return self._routed(x, shared.w2(self.ops.swiglu(gate, up, self.limit)), weights=weights, ids=ids)

    def _shared_cast(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert on activations cast to :attr:`activation_format`, in ``x.dtype``."""
        ops, shared, fmt = self.ops, self.shared_experts, self.activation_format
        hidden, = ops.stacked_linear(ops.quantize_activations(x, fmt), [shared.w1.operand(), shared.w3.operand()],
                                     swiglu=True, swiglu_limit=self.limit)
        return ops.linear(ops.quantize_activations(hidden, fmt), shared.w2.operand()).to(x.dtype)

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.moe_gate(logits, self.gate.bias, self.top_k, self.routed_scale)

    def _routed(self, x: torch.Tensor, shared: torch.Tensor, logits: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output rounded to ``x.dtype``, plus ``shared`` (the shared expert's,
        in ``x.dtype``): the gate on ``logits`` with the dispatch (``moe_route``; or the dispatch of
        the given ``weights`` and ``ids``), the grouped SwiGLU and down GEMMs (the down GEMM writes
        ``x.dtype``, as DeepInfer's writes bf16 for its combine), combine (which adds it).
        With FP8 activations the router weights multiply the SwiGLU's float32 products ahead of
        their cast, as DeepInfer's fused SwiGLU and cast does, and combine sums the rows as they
        are; otherwise combine weights them."""
        ops, experts = self.ops, self.experts
        if logits is not None and self.eplb is None:
            _, _, rows, group_sizes, handle = ops.moe_route(x, logits, self.gate.bias, self.top_k, self.routed_scale,
                                                            self.ep_group)
        else:
            if logits is not None:
                weights, ids = self._select(logits)
            if self.eplb is None:
                rows, group_sizes, handle = ops.ep_dispatch(x, ids, weights, self.num_experts, self.ep_group)
            else:
                rows, group_sizes, handle = ops.ep_dispatch(x, self.eplb.route(ids), weights, self.eplb.num_physical,
                                                            self.ep_group)
        fmt = self.activation_format
        if fmt is not None:
            rows = ops.quantize_activations(rows, fmt)
        hidden = ops.grouped_swiglu(rows, experts.operand("w1"), experts.operand("w3"), group_sizes, self.limit,
                                    x.dtype if fmt is None else torch.float32)
        weighted = fmt is None or handle.row_weights is None
        if fmt is not None:
            hidden = ops.quantize_activations(hidden, fmt, None if weighted else handle.row_weights)
        down = ops.grouped_gemm(hidden, experts.operand("w2"), group_sizes, out_dtype=x.dtype)
        return ops.ep_combine(down, handle, add=shared, weighted=weighted)


def cast_expert_activations(model: nn.Module, fmt: str | None) -> nn.Module:
    """:meth:`MoE.cast_activations` of every MoE layer of ``model`` (returned)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.cast_activations(fmt)
    return model

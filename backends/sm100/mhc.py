"""sm100 ``mhc_mixes``: the normalised mixes as one float32 GEMM, then the gates and the
whole Sinkhorn normalisation of each token's stream-mixing matrix in one Triton kernel
(:mod:`.fused.mhc_mixes`) instead of a few kernels per iteration."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.mhc import normalized_mixes
from deepinfer_backends.sm100.launch import require

MAX_STREAMS = 16


def mhc_mixes(residual, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters):
    """HAL ``mhc_mixes`` for a CUDA ``residual [T, hc, H]`` (bf16 or float32), ``hc`` a power of
    two up to :data:`MAX_STREAMS`; float32 ``(pre [T, hc], post [T, hc], comb [T, hc, hc])``."""
    op = "mhc_mixes"
    require(isinstance(residual, torch.Tensor) and residual.is_cuda and residual.dim() == 3, op,
            "residual must be a [T, hc, H] CUDA tensor")
    tokens, hc, hidden = residual.shape
    require(0 < hc <= MAX_STREAMS and hc & (hc - 1) == 0, op,
            f"the stream count hc={hc} must be a power of two up to {MAX_STREAMS}")
    rows = hc * (2 + hc)
    for name, tensor, shape in (("fn", fn, (rows, hc * hidden)), ("scale", scale, (3,)), ("base", base, (rows,))):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if sinkhorn_iters < 0:
        raise ValueError(f"{op}: sinkhorn_iters must be >= 0, got {sinkhorn_iters}")
    from deepinfer_backends.sm100.fused.mhc_mixes import BLOCK_TOKENS, mhc_mixes_kernel

    mixes = normalized_mixes(residual, fn, norm_eps)
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=residual.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=residual.device)
    if tokens:
        grid = (-(-tokens // BLOCK_TOKENS),)
        mhc_mixes_kernel[grid](mixes, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, tokens,
                               mixes.stride(0), float(hc_eps), HC=hc, ITERS=int(sinkhorn_iters), BLOCK=BLOCK_TOKENS,
                               num_warps=4)
    return pre, post, comb

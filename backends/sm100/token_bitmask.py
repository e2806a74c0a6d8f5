"""sm100 ``apply_token_bitmask``: one Triton launch that writes ``-inf`` at the disallowed tokens
(:mod:`.fused.token_bitmask`)."""
from __future__ import annotations

from deepinfer.hal.ops.token_bitmask import check_bitmask_args
from deepinfer_backends.sm100.launch import on_device, require


def apply_token_bitmask(logits, bitmask, rows=None):
    """HAL ``apply_token_bitmask`` for CUDA ``logits`` float32 ``[N, V]`` (any strides) and a CUDA
    ``bitmask`` (and ``rows``): disallowed logits set to ``-inf`` in place; returns ``logits``.
    Allowed logits keep their exact bits (``-0.0`` included)."""
    op = "apply_token_bitmask"
    check_bitmask_args(logits, bitmask, rows)
    for name, value in (("logits", logits), ("bitmask", bitmask), ("rows", rows)):
        require(value is None or on_device(value), op, f"{name} must be a CUDA tensor")
    masks, words = bitmask.shape
    if not masks or not words:
        return logits
    import triton
    from deepinfer_backends.sm100.fused.token_bitmask import BLOCK_WORDS, token_bitmask_kernel

    bitmask = bitmask.contiguous()
    token_bitmask_kernel[(masks, triton.cdiv(words, BLOCK_WORDS))](
        logits, bitmask, bitmask if rows is None else rows.contiguous(), logits.shape[1], words, logits.stride(0),
        logits.stride(1), HAS_ROWS=rows is not None, BLOCK_WORDS=BLOCK_WORDS, num_warps=4)
    return logits

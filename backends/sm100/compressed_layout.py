"""sm100 ``compressed_decode_layout``: one Triton launch (:mod:`.fused.compressed_layout`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.compressed_layout import check_layout_args
from deepinfer_backends.sm100.launch import on_device, require


def compressed_decode_layout(block_tables, context_lens, positions, seq_of_token, ratio, tokens_per_block):
    """HAL ``compressed_decode_layout`` for CUDA tensors: ``(rows int32 [B, W * tokens_per_block
    + 1], visible, store_rows, key_positions int64 [T])``."""
    check_layout_args(block_tables, context_lens, positions, seq_of_token, ratio, tokens_per_block)
    for name, tensor in (("block_tables", block_tables), ("context_lens", context_lens), ("positions", positions),
                         ("seq_of_token", seq_of_token)):
        require(on_device(tensor), "compressed_decode_layout", f"{name} must be a CUDA tensor, got {tensor.device}")
    import triton

    from deepinfer_backends.sm100.fused.compressed_layout import BLOCK, compressed_layout_kernel

    batch, width = block_tables.shape
    tokens, device = positions.shape[0], positions.device
    rows = torch.empty(batch, width * tokens_per_block + 1, dtype=torch.int32, device=device)
    visible, store_rows, key_positions = (torch.empty(tokens, dtype=torch.int64, device=device) for _ in range(3))
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    grid = (triton.cdiv(max(rows.shape[1], tokens, 1), BLOCK), batch + 1)
    compressed_layout_kernel[grid](block_tables, context_lens.contiguous(), positions.contiguous(),
                                   seq_of_token.contiguous(), rows, visible, store_rows, key_positions, batch, tokens,
                                   width, max(block_tables.stride(0), 1), ratio, tokens_per_block, BLOCK=BLOCK,
                                   num_warps=4)
    return rows, visible, store_rows, key_positions

"""sm100 ``indexer_topk``: a radix select and an ordered write per row in one Triton kernel
(:mod:`.fused.indexer_topk`)."""
from __future__ import annotations

import functools

import torch

from deepinfer.hal.ops.indexer import check_windows
from deepinfer_backends.sm100.launch import on_device, require

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_INDEX = 2 ** 31 - 1
INTERPRETED_PROGRAMS = 3
"""Programs of a launch off the GPU (Triton's interpreter), so that programs take several rows."""


def indexer_topk(logits, starts, lengths, k, row_table=None):
    """HAL ``indexer_topk`` for CUDA ``logits [T, S]`` (float32, or bf16 / fp16 compared as their
    float32 values): int32 ``[T, k]`` window offsets of each row's ``k`` best columns, ties to
    the lower column, ascending, -1 padded (or, with ``row_table``, its entries at those offsets,
    read as they are written). A fixed number of programs per GPU share the rows, each with a
    small scratch row; logits whose last axis is strided are copied first."""
    op = "indexer_topk"
    require(on_device(logits), op, "logits must be a CUDA tensor")
    check_windows(logits, starts, lengths, k, row_table)
    if row_table is not None:
        require(on_device(row_table), op, "row_table must be a CUDA tensor")
        if row_table.shape[1] > 1 and row_table.stride(1) != 1:
            row_table = row_table.contiguous()
    require(logits.dtype in LOGIT_DTYPES, op, f"logits must be float32, bf16 or fp16, got {logits.dtype}")
    require(on_device(starts) and on_device(lengths), op, "starts and lengths must be CUDA tensors")
    require(logits.shape[1] <= MAX_INDEX and k <= MAX_INDEX, op,
            f"S ({logits.shape[1]}) and k ({k}) must fit int32 column offsets")
    from deepinfer_backends.sm100.fused.indexer_topk import (BLOCK, CANDIDATES, NUM_WARPS, RADIX_BITS,
                                                             indexer_topk_kernel)

    tokens, width = logits.shape
    out = torch.empty(tokens, k, dtype=torch.int32, device=logits.device)
    if not tokens:
        return out
    if width > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    programs = min(tokens, _program_slots(logits.device))
    scratch = torch.empty(programs, 2, CANDIDATES, dtype=torch.int32, device=logits.device)
    extent = (tokens - 1) * logits.stride(0) + width
    table = out if row_table is None else row_table
    indexer_topk_kernel[(programs,)](logits, starts.contiguous(), lengths.contiguous(), out, scratch, table, tokens,
                                     logits.stride(0), table.stride(0), extent, k, HAS_TABLE=row_table is not None,
                                     BLOCK=BLOCK, CANDIDATES=CANDIDATES, RADIX_BITS=RADIX_BITS,
                                     num_warps=NUM_WARPS)
    return out


@functools.lru_cache(maxsize=None)
def _program_slots(device: torch.device) -> int:
    """Programs one launch runs on ``device``: a few per multiprocessor on a GPU."""
    from deepinfer_backends.sm100.fused.indexer_topk import PROGRAMS_PER_SM

    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count

"""sm100 ``kv_load``: cache rows at flat slots decoded to float32 or bf16 in one Triton kernel
(:mod:`.fused.kv_load`)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import LOAD_DTYPES, cache_rows, check_slots
from deepinfer_backends.sm100.launch import on_device, require

KINDS = {"bf16": 0, "index_bf16": 0, "fp8": 1, "fp4": 2, "index_fp4": 3}
"""Each cache format and the kernel's decoding of it."""


def kv_load(cache, slots, fmt, dtype=torch.float32):
    """HAL ``kv_load`` for a CUDA ``cache``: ``dtype`` (float32 or bfloat16) ``[n, dim]``."""
    op = "kv_load"
    require(on_device(cache) and on_device(slots), op, "cache and slots must be CUDA tensors")
    require(fmt in KINDS, op, f"format {fmt!r} has no kernel (formats: {sorted(KINDS)})")
    spec = token_format(fmt)
    rows = cache_rows(cache, spec)
    check_slots(slots, rows.shape[0], (torch.int64, torch.int32))
    require(dtype in LOAD_DTYPES, op, f"kv_load decodes to one of {LOAD_DTYPES}, got dtype={dtype}")
    from deepinfer_backends.sm100.fused.kv_load import BLOCK_ROWS, kv_load_kernel

    count = slots.shape[0]
    out = torch.empty(count, spec.dim, dtype=dtype, device=cache.device)
    if count:
        kv_load_kernel[(-(-count // BLOCK_ROWS),)](
            rows, rows.view(torch.bfloat16), rows.view(torch.float8_e4m3fn), slots.contiguous(), out, count,
            ROW_BYTES=spec.bytes_per_token, DIM=spec.dim, KIND=KINDS[fmt], BLOCK_ROWS=BLOCK_ROWS, num_warps=4)
    return out

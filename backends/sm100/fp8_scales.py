"""Block scales moved between granularities for the native FP8 grouped GEMM
(``kernels/grouped_gemm_fp8_k128.py``), in PyTorch on any device: the HAL's UE8M0 scales per 32
along K to one float32 power of two per 128 values (activations) or per row (weights), and the
activations' scales gathered per output tile."""
from __future__ import annotations

import torch

GROUP = 128
"""Values of K under one activation scale, and the kernel's k-block."""
BLOCK_M = 128
"""Rows of the kernel's output tile."""
MXFP4_SHIFT = 6
"""MXFP4's e2m1 values are held as e4m3 times ``2 ** MXFP4_SHIFT`` (6 x 64 = 384 <= 448)."""
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def align_reference(values: torch.Tensor, exponents: torch.Tensor, group: int = GROUP
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``[..., k]`` and float32 scales ``[..., k/group]`` holding ``values`` (float ``[..., k]``,
    each block of 32 already a float exactly times ``2 ** exponents[..., k/32]``, int): per
    ``group`` values the largest exponent ``E`` is kept, each block's values are multiplied by
    ``2 ** (its exponent - E)`` and rounded to e4m3 (nearest, ties to even), and the scale is
    ``2 ** E``. Exact while a block's values stay e4m3 numbers after the shift (for MXFP4
    weights, always when the exponents of a group span at most 14)."""
    lead = values.shape[:-1]
    k = values.shape[-1]
    exp = exponents.to(torch.int32).reshape(*lead, k // group, group // 32)
    top = exp.amax(-1, keepdim=True)
    shift = torch.exp2((exp - top).to(torch.float32)).unsqueeze(-1)
    grouped = values.to(torch.float32).reshape(*lead, k // group, group // 32, 32)
    data = (grouped * shift).reshape(*lead, k).to(torch.float8_e4m3fn)
    return data, torch.exp2(top.squeeze(-1).to(torch.float32))


def aligned(q, group: int | None = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., k], float32 scale [..., k/group])`` of a :class:`~deepinfer.hal.formats.Quantized`
    ``fp8`` or ``mxfp4`` operand with UE8M0 scales per 32 (byte 0 reads as a zero block, as in the
    other block-scaled kernels), by :func:`align_reference`; ``group`` None: one scale a row
    (``[...]``), as the kernel takes the weights. e4m3 values stay exact while they stay in
    e4m3's normal range after the shift, MXFP4 values while a group's scales span at most 14
    binades."""
    scale = q.scale.to(torch.int32)
    if q.fmt == "mxfp4":
        table = torch.tensor(_E2M1, device=q.data.device) * 2.0 ** MXFP4_SHIFT
        codes = torch.stack((q.data & 15, q.data >> 4), dim=-1).flatten(-2).long()
        values, exponents = table[codes], scale - 127 - MXFP4_SHIFT
    else:
        values, exponents = q.data.float(), scale - 127
    values = values.unflatten(-1, (-1, 32)).masked_fill((scale == 0).unsqueeze(-1), 0.0).flatten(-2)
    data, group_scale = align_reference(values, exponents, group or values.shape[-1])
    return data.contiguous(), (group_scale if group else group_scale.squeeze(-1)).contiguous()


def tile_scales(x_scale: torch.Tensor, schedule: torch.Tensor) -> torch.Tensor:
    """``x_scale [m, k/128]`` as the kernel reads it, over the tiles of ``schedule int32 [3, tiles]``
    (expert, first row, end row): ``[k/128, tiles * 128]``, column ``128 t + i`` the scales of row
    ``first[t] + i`` while that row is before ``end[t]``, else 1 (a row the kernel never stores)."""
    rows = schedule[1].long()[:, None] + torch.arange(BLOCK_M, device=schedule.device)
    live = (rows < schedule[2].long()[:, None]).flatten()
    gathered = x_scale.index_select(0, rows.clamp_(0, max(x_scale.shape[0] - 1, 0)).flatten())
    return gathered.masked_fill_(~live[:, None], 1.0).T.contiguous()

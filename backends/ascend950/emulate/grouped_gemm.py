"""Emulated ascend950 grouped GEMM: per expert segment, output tiles of ``base_m x base_n`` spread
over the AI cores; each tile accumulates ``base_k``-deep cube steps in float32 (L0C) and is
rounded once as it is copied out. FP8 operands (A5) multiply e4m3 values per 32-deep scale block
and apply both UE8M0 scales to each block's partial sum before it joins the accumulator; the
kernel reads the scales packed two per int16, as DeepInfer packs them on Ascend."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer.hal.formats import Quantized, ue8m0_to_float
from deepinfer.hal.ops.grouped_gemm import check_grouped_gemm, check_grouped_out_dtype
from deepinfer_backends.ascend950.buffers import AI_CORES, Buffer, layout
from deepinfer_backends.ascend950.emulate.plan import BlockPlan, WriteRecord

SCALE_BLOCK = 32


@dataclass(frozen=True)
class GemmTiles:
    """One cube tile shape: ``base_m x base_n`` outputs, ``base_k`` deep a step, ``stages`` K
    steps staged in L1 at once; ``element`` bytes per operand value."""

    base_m: int
    base_n: int
    base_k: int
    element: int
    stages: int = 4

    def buffers(self, out_bytes: int) -> tuple[Buffer, ...]:
        """On-chip buffers in layout order: the operands' K steps in L1, one step of each in L0A
        and L0B, the float32 accumulator in L0C; in a vector core's UB, its half of the
        accumulator and of the output tile (the native kernel,
        :mod:`~deepinfer_backends.ascend950.kernels.grouped_gemm`, places them at these offsets)."""
        m, n, k, e = self.base_m, self.base_n, self.base_k, self.element
        return (Buffer("a_l1", "L1", m * k * self.stages * e, copies=2),
                Buffer("b_l1", "L1", n * k * self.stages * e, copies=2),
                Buffer("a_l0", "L0A", m * k * e, copies=2), Buffer("b_l0", "L0B", n * k * e, copies=2),
                Buffer("acc", "L0C", m * n * 4), Buffer("acc_ub", "UB", m // 2 * n * 4),
                Buffer("out_ub", "UB", m // 2 * n * out_bytes, copies=2))

    def fp8_buffers(self, k: int) -> tuple[Buffer, ...]:
        """The FP8 kernel's buffers for a K of ``k``, in layout order: the operands' K steps in
        L1, one 32-deep scale block of each in L0A and L0B (double-buffered), the float32 block
        sum in L0C; in a vector core's UB, its half of the accumulator and of the block sum, its
        rows' packed scales, the tile's weight rows' packed scales, and one block's weight and row
        scales as floats. The native kernel,
        :mod:`~deepinfer_backends.ascend950.kernels.grouped_gemm_fp8`, places them here."""
        m, n, bk, half = self.base_m, self.base_n, self.base_k, self.base_m // 2
        return (Buffer("a_l1", "L1", m * bk * self.stages, copies=2),
                Buffer("b_l1", "L1", n * bk * self.stages, copies=2),
                Buffer("a_l0", "L0A", m * SCALE_BLOCK, copies=2), Buffer("b_l0", "L0B", n * SCALE_BLOCK, copies=2),
                Buffer("acc", "L0C", m * n * 4), Buffer("acc_ub", "UB", half * n * 4),
                Buffer("partial", "UB", half * n * 4), Buffer("a_scales", "UB", half * k // 64 * 2),
                Buffer("b_scales", "UB", n * k // 64 * 2), Buffer("b_row", "UB", n * 4),
                Buffer("a_row", "UB", half * 4))


TILES = {torch.bfloat16: GemmTiles(128, 256, 64, 2), torch.float32: GemmTiles(128, 128, 32, 4),
         "fp8": GemmTiles(128, 256, 128, 1)}
"""The served tile shape by operand type (checked against the A5 buffers when first used)."""


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes ``[..., 2j]``, ``[..., 2j + 1]`` packed into one int16 (low byte first)."""
    if scale.shape[-1] % 2:
        scale = torch.cat((scale, torch.full_like(scale[..., :1], 127)), dim=-1)
    pairs = scale.to(torch.int32).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 8)).to(torch.int16)


def unpack_scales(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The UE8M0 bytes of :func:`pack_scales`, the first ``count`` of each row."""
    words = packed.to(torch.int32) & 0xFFFF
    return torch.stack((words & 0xFF, words >> 8), dim=-1).flatten(-2)[..., :count].to(torch.uint8)


def grouped_gemm(x, weight, group_sizes: torch.Tensor, out_dtype: torch.dtype | None = None,
                 platform: str = "A5") -> torch.Tensor:
    """:func:`deepinfer.hal.ops.grouped_gemm.grouped_gemm` as the ascend950 kernel plans it (a
    bf16 ``out_dtype`` rounds the kernel's float32 result afterwards)."""
    check_grouped_gemm(x, weight, group_sizes)
    result_dtype = check_grouped_out_dtype(x, weight, out_dtype)
    quantized = isinstance(x, Quantized) or isinstance(weight, Quantized)
    if quantized and not (isinstance(x, Quantized) and isinstance(weight, Quantized)
                          and x.fmt == weight.fmt == "fp8"):
        raise UnsupportedInput(f"ascend950 grouped_gemm takes FP8 x FP8 (A5) or plain operands, got x "
                               f"{_kind(x)} and weight {_kind(weight)} (the 950's cube has no FP4 path and no mixed "
                               f"bf16 x FP8 GEMM); set backend.fallback=reference for these")
    if quantized and platform != "A5":
        raise UnsupportedInput(f"FP8 cube GEMMs exist on A5 (the 950) only, not {platform}")
    if not quantized and x.dtype not in TILES:
        raise UnsupportedInput(f"ascend950 grouped_gemm takes bf16 or float32 operands, got {x.dtype}")
    tiles = TILES["fp8" if quantized else x.dtype]
    kernel_dtype = torch.float32 if quantized else x.dtype
    layout(tiles.buffers(torch.finfo(kernel_dtype).bits // 8), platform)
    rows, n = (x.data if quantized else x).shape[0], (weight.data if quantized else weight).shape[1]
    out = torch.zeros(rows, n, dtype=kernel_dtype)
    record = WriteRecord(rows, n)
    plan = BlockPlan(AI_CORES[platform])
    start = 0
    for expert, size in enumerate(group_sizes.tolist()):
        for m0 in range(start, start + size, tiles.base_m):
            for n0 in range(0, n, tiles.base_n):
                plan.add((expert, m0, min(m0 + tiles.base_m, start + size), n0, min(n0 + tiles.base_n, n)))
        start += size
    for core_tiles in plan.per_core():
        for expert, m0, m1, n0, n1 in core_tiles:
            acc = _fp8_tile(x, weight, expert, m0, m1, n0, n1, tiles) if quantized else \
                _plain_tile(x, weight, expert, m0, m1, n0, n1, tiles)
            out[m0:m1, n0:n1] = acc.to(kernel_dtype)
            record.store(slice(m0, m1), slice(n0, n1))
    record.check(start)
    return out.to(group_sizes.device, result_dtype)


def _kind(operand) -> str:
    return operand.fmt if isinstance(operand, Quantized) else str(operand.dtype).replace("torch.", "")


def _plain_tile(x, weight, expert, m0, m1, n0, n1, tiles: GemmTiles) -> torch.Tensor:
    a, b = x[m0:m1].float(), weight[expert, n0:n1].float()
    acc = torch.zeros(m1 - m0, n1 - n0, dtype=torch.float32)
    for k0 in range(0, a.shape[1], tiles.base_k):
        acc += a[:, k0:k0 + tiles.base_k] @ b[:, k0:k0 + tiles.base_k].T
    return acc


def _fp8_tile(x: Quantized, weight: Quantized, expert, m0, m1, n0, n1, tiles: GemmTiles) -> torch.Tensor:
    a, b = x.data[m0:m1].float(), weight.data[expert, n0:n1].float()
    blocks = a.shape[1] // SCALE_BLOCK
    a_scale = ue8m0_to_float(unpack_scales(pack_scales(x.scale[m0:m1]), blocks))
    b_scale = ue8m0_to_float(unpack_scales(pack_scales(weight.scale[expert, n0:n1]), blocks))
    acc = torch.zeros(m1 - m0, n1 - n0, dtype=torch.float32)
    for k0 in range(0, a.shape[1], tiles.base_k):
        for j in range(k0 // SCALE_BLOCK, min(k0 + tiles.base_k, a.shape[1]) // SCALE_BLOCK):
            part = a[:, j * SCALE_BLOCK:(j + 1) * SCALE_BLOCK] @ b[:, j * SCALE_BLOCK:(j + 1) * SCALE_BLOCK].T
            acc += part * a_scale[:, j, None] * b_scale[None, :, j]
    return acc

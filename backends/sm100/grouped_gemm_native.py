"""``grouped_gemm`` on Hopper's FP8 tensor cores (``backend.options.quant_gemm=native``): FP8
activations x FP8 or MXFP4 expert weights through :mod:`.kernels.grouped_gemm_fp8_k128`, with the
operands' UE8M0 scales per 32 along K moved to the kernel's granularity (see that option for
the numbers it gives)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP, aligned
from deepinfer_backends.sm100.gemm import SKINNY_ROWS_PER_EXPERT, shared_schedule
from deepinfer_backends.sm100.launch import compiled, param_copy, require

NATIVE_TILES = {"block_n": 208}
"""Tiles of the native FP8 grouped GEMM (128 rows a tile): 208 columns, the faster beside 192 at
K 2048 and 4096 on an H100 once the column scales are read before the mainloop
(``experiments/results/fp8_grouped_gemm_epilogue.md``). The promoted accumulator and the partial
take 104 registers each."""
BLOCKS_A_CTA = (5, 2)
"""Column blocks one CTA may take in turn with the bf16 epilogue, the first that divides the
column blocks and leaves :data:`MIN_WAVES` waves: its producer loads the next block while the
consumers store. The bf16 result gains from it at K 2048 and keeps its rate at 4096; the float32
one does not gain (``experiments/results/fp8_grouped_gemm_epilogue.md``)."""
MIN_WAVES = 2
"""Fewest waves of CTAs (one a streaming multiprocessor) a choice of several blocks a CTA must
leave: with fewer, the last wave's idle SMs cost more than the stores hidden."""


def native_blocks(rows: int, n: int, sms: int, bf16: bool) -> int:
    """Column blocks a CTA for ``rows`` rows (at least ``rows / 128`` row tiles) and ``n`` columns on
    a GPU of ``sms`` SMs: one for a float32 result, else the first of :data:`BLOCKS_A_CTA` that
    divides the column blocks and leaves :data:`MIN_WAVES` waves."""
    columns = -(-n // NATIVE_TILES["block_n"])
    tiles = rows // BLOCK_M
    if bf16:
        for blocks in BLOCKS_A_CTA:
            if columns % blocks == 0 and tiles * (columns // blocks) >= MIN_WAVES * sms:
                return blocks
    return 1


def native_fits(x, rows: int, experts: int, k: int, arch: str, batch_invariant: bool, tcgen05: bool) -> bool:
    """Whether ``quant_gemm=native`` takes the FP8 tensor cores for ``x [rows, k]`` on a GPU of
    ``arch``: FP8 activations on Hopper, ``k`` a positive multiple of 128, more than
    ``SKINNY_ROWS_PER_EXPERT`` rows per expert on average (fewer stream the weights, which the
    exact kernel for few rows does as fast), outside the batch-invariant mode and ``tcgen05``."""
    return (isinstance(x, Quantized) and arch == toolchain.HOPPER and not batch_invariant and not tcgen05
            and k > 0 and k % GROUP == 0 and rows > SKINNY_ROWS_PER_EXPERT * experts)


def grouped_gemm_native(x: Quantized, weight: Quantized, group_sizes: torch.Tensor, op: str = "grouped_gemm",
                        schedules: dict | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``grouped_gemm`` of FP8 ``x`` and ``weight`` (checked by the caller) on the native kernel, float32
    result, or bf16 rounded in the kernel's epilogue for ``out_dtype=torch.bfloat16`` (N a multiple
    of 8; other N are rounded after): the activations' scales moved to one per 128 along K and
    gathered per tile by :func:`~.fused.align_fp8.align_fp8` every call, the weights' to one per
    output column once per parameter (:func:`~.launch.param_copy` keyed by the data; e4m3 copies,
    so MXFP4 weights take twice their bytes again)."""
    from deepinfer_backends.sm100.fused.align_fp8 import align_fp8
    from deepinfer_backends.sm100.kernels import grouped_gemm_fp8_k128 as native

    tensors = (x.data, x.scale, weight.data, weight.scale)
    require(all(t.is_cuda for t in tensors), op,
            f"operands must be CUDA tensors, got {[str(t.device) for t in tensors]}")
    w, w_scale = param_copy(weight.data, "fp8_k128_columns", lambda _: aligned(weight, group=None))
    rows, n = x.data.shape[0], w.shape[1]
    bf16_epilogue = out_dtype == torch.bfloat16 and n % 8 == 0
    y = torch.empty(rows, n, dtype=torch.bfloat16 if bf16_epilogue else torch.float32, device=x.data.device)
    if rows:
        schedule = shared_schedule(group_sizes, rows, BLOCK_M, x.data.device, schedules)
        x_data, x_scale = align_fp8(x.data, x.scale, schedule)
        sms = torch.cuda.get_device_properties(x.data.device).multi_processor_count
        tiles = dict(NATIVE_TILES, out_dtype="bfloat16" if bf16_epilogue else "float32",
                     blocks=native_blocks(rows, n, sms, bf16_epilogue))
        compiled(native.MODULE, "grouped_gemm_fp8_k128", *w.shape, **tiles)(
            x_data, x_scale, w, w_scale, schedule[0], schedule[1], schedule[2], y)
    return y.to(out_dtype)

"""sm100 HAL ``linear``: the Triton kernel for few rows (bf16 or FP8 weights), cuBLAS for a bf16
weight above it, or the grouped GEMM of :mod:`.gemm` with one expert (``linear_kernel=tilelang``,
the batch-invariant mode and block-scaled operands)."""
from __future__ import annotations

import functools

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_gemm import check_out_dtype
from deepinfer_backends.sm100.gemm import ONE_EXPERT_TILE_ROWS, _grouped_gemm_quant, gemm_tiles
from deepinfer_backends.sm100.launch import compiled, cuda_bf16, float32_param, on_device, require
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions


def linear(x, weight, out_dtype: torch.dtype | None = None, batch_invariant: bool = False,
           options: KernelOptions = DEFAULT) -> torch.Tensor:
    """HAL ``linear``, ``y[..., N] = x[..., K] @ weight[N, K].T``: the Triton kernel for few rows
    where it serves (:func:`few_rows_linears`), else the grouped GEMM kernel with one expert (its
    tile schedule built once per row count, with no host sync), or cuBLAS for a bf16 weight where
    ``options.linear_kernel`` picks it (:func:`linear_kernel`). Each writes its float32
    accumulator unrounded for ``out_dtype=torch.float32``."""
    op = "linear"
    check_out_dtype(op, out_dtype)
    if isinstance(x, Quantized) or isinstance(weight, Quantized):
        products = None if isinstance(x, Quantized) else few_rows_linears(x, [weight], batch_invariant, options)
        return products[0] if products is not None else _linear_quant(x, weight, batch_invariant, options)
    cuda_bf16(op, "x", x)
    cuda_bf16(op, "weight", weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear expects x [..., K] and weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    products = few_rows_linears(x, [weight], batch_invariant, options, out_dtype=out_dtype)
    if products is not None:
        return products[0]
    if linear_kernel(options, batch_invariant) == "cublas" and (out_dtype is None or _CUBLAS_FLOAT32_OUT):
        if out_dtype is None:
            return torch.nn.functional.linear(x, weight)
        return torch.mm(x.reshape(rows, x.shape[-1]), weight.t(), out_dtype=out_dtype).view(*x.shape[:-1], -1)
    require(x.shape[-1] % 8 == 0, op, f"K={x.shape[-1]} must be a multiple of 8 (16-byte rows for TMA)")
    flat, weight = x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous()
    n = weight.shape[0]
    tiles = gemm_tiles(rows, 1, n, weight.shape[1], batch_invariant=batch_invariant)
    y = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows:
        schedule = _single_expert_schedule(rows, tiles["block_m"], x.device)
        wide = {} if out_dtype is None else {"out_dtype": "float32"}
        kernel = compiled("grouped_gemm", "grouped_gemm_bf16", 1, *weight.shape, **tiles, **wide)
        kernel(flat, weight.unsqueeze(0), schedule[0], schedule[1], schedule[2], y)
    return y.reshape(*x.shape[:-1], n)


_CUBLAS_FLOAT32_OUT = torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")
"""Whether this torch's cuBLAS ``mm`` writes a bf16 product in float32 (``out_dtype``); where it
cannot, a float32 ``linear`` takes the TileLang GEMM."""


def few_rows_linears(x, weights, batch_invariant: bool = False, options: KernelOptions = DEFAULT,
                     rope: tuple | None = None,
                     swiglu: tuple[float | None] | None = None,
                     out_dtype: torch.dtype | None = None,
                     norm: tuple[torch.Tensor, float] | None = None,
                     mxfp4: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
    """``x`` through each of ``weights`` in one Triton launch (:mod:`.fused.linear_skinny`) under
    ``options.linear_kernel=auto``, outside the batch-invariant mode, for bf16 CUDA ``x`` of at most
    :data:`~.fused.linear_skinny.BLOCK_T` rows and bf16 CUDA weights whose widths the kernel's column
    blocks divide (ahead of cuBLAS on model=small's decode shapes but shared.w2 at 16 rows:
    ``experiments/results/linear_stacked_h200.csv``), or weights that are all FP8
    (:func:`_fp8_weight`; products float32 by default, ``linear``'s dtype for quantized operands);
    None where it does not serve. ``rope`` (``(positions, cos_sin, head width per weight)``, the
    HAL ``stacked_linear``'s RoPE) is applied in the kernel's epilogue where the column blocks
    divide the head widths and their rotated parts; None where it cannot be. ``swiglu``
    (``(limit,)``): the last two weights are a gate and an up projection whose SwiGLU the kernel
    stores in place of both. ``out_dtype``: the products' dtype (default bf16, float32 for FP8
    weights). ``norm`` (``(weight [K], eps)``): the products of ``x`` (bf16 or float32)
    RMS-normalised and rounded to bf16, where ``K`` is at most
    :data:`~.fused.linear_skinny.NORM_MAX_K` (None above it). ``mxfp4``: the products (indices)
    cast through MXFP4 in the epilogue, where the column tiles are 32 wide (None where not)."""
    from deepinfer_backends.sm100.fused.linear_skinny import BLOCK_T, MAX_WEIGHTS, NORM_MAX_K, linear_skinny, tiles_for

    inputs = (torch.bfloat16, torch.float32) if norm is not None else (torch.bfloat16,)
    if batch_invariant or options.linear_kernel != "auto" or not on_device(x) or x.dtype not in inputs:
        return None
    if norm is not None and x.shape[-1] > NORM_MAX_K:
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fp8 = all(_fp8_weight(w) for w in weights)
    if not 0 < rows <= BLOCK_T or not (fp8 or all(isinstance(w, torch.Tensor) and on_device(w)
                                                  and w.dtype == torch.bfloat16 for w in weights)):
        return None
    if fp8:
        weights = [Quantized(w.data.contiguous(), w.scale.contiguous(), w.fmt, w.block) for w in weights]
    tiles = tiles_for([(w.data if fp8 else w).shape[0] for w in weights])
    if tiles is None or (swiglu is not None and len(weights) > MAX_WEIGHTS + 1) or (mxfp4 and tiles["block_n"] % 32):
        return None
    if rope is not None:
        positions, cos_sin, heads = rope
        if any(head % tiles["block_n"] or (head - cos_sin.shape[1]) % tiles["block_n"] for head in heads if head):
            return None
        rope = (positions.contiguous(), cos_sin.float().contiguous(), list(heads))
    flat = x.reshape(rows, x.shape[-1])
    products = linear_skinny(flat if flat.stride(-1) == 1 else flat.contiguous(),
                             weights if fp8 else [w.contiguous() for w in weights], tiles, rope=rope,
                             gated=swiglu is not None, limit=swiglu[0] if swiglu is not None else None,
                             out_dtype=out_dtype, norm=None if norm is None else (float32_param(norm[0]), norm[1]),
                             mxfp4=tuple(mxfp4))
    return tuple(y.view(*x.shape[:-1], y.shape[1]) for y in products)


def _fp8_weight(w) -> bool:
    """``w`` is an FP8 weight the kernel for few rows reads: Quantized ``"fp8"`` with blocks of 32,
    on the device, ``[N, K]`` with K a multiple of 32 and uint8 scales."""
    return (isinstance(w, Quantized) and w.fmt == "fp8" and w.block == 32 and on_device(w.data)
            and w.data.dtype == torch.float8_e4m3fn and w.data.dim() == 2 and w.data.shape[1] % 32 == 0
            and w.scale.dtype == torch.uint8 and tuple(w.scale.shape) == (w.data.shape[0], w.data.shape[1] // 32))


def linear_kernel(options: KernelOptions = DEFAULT, batch_invariant: bool = False) -> str:
    """``"cublas"`` or ``"tilelang"``: the kernel of a bf16 ``linear`` above the Triton kernel's
    few rows (:attr:`KernelOptions.linear_kernel`)."""
    if batch_invariant:
        if options.linear_kernel == "cublas":
            raise RuntimeError("backend.options.linear_kernel=cublas cannot serve batch-invariant mode: cuBLAS "
                               "picks its kernel by shape. Use linear_kernel=auto or tilelang")
        return "tilelang"
    return "cublas" if options.linear_kernel == "auto" else options.linear_kernel


def _linear_quant(x, weight, batch_invariant: bool, options: KernelOptions = DEFAULT) -> torch.Tensor:
    """``linear`` with block-scaled operands: the block-scaled grouped GEMM with one expert, with
    ``options``' kernel choices (``quant_gemm``, ``tcgen05``), its segment size and tile schedules
    made once per row count (no launch per call)."""
    def rows(operand):
        if not isinstance(operand, Quantized):
            return operand.reshape(-1, operand.shape[-1])
        return Quantized(operand.data.reshape(-1, operand.data.shape[-1]),
                         operand.scale.reshape(-1, operand.scale.shape[-1]), operand.fmt, operand.block)

    def one_expert(operand):
        if not isinstance(operand, Quantized):
            return operand.unsqueeze(0)
        return Quantized(operand.data.unsqueeze(0), operand.scale.unsqueeze(0), operand.fmt, operand.block)

    data = x.data if isinstance(x, Quantized) else x
    w_data = weight.data if isinstance(weight, Quantized) else weight
    if data.dim() < 1 or w_data.dim() != 2:
        raise ValueError(f"linear expects x [..., K] and weight [N, K]; got x {tuple(data.shape)}, "
                         f"weight {tuple(w_data.shape)}")
    flat = rows(x)
    count = (flat.data if isinstance(flat, Quantized) else flat).shape[0]
    schedules = {(count, tile_rows): _single_expert_schedule(count, tile_rows, data.device)
                 for tile_rows in ONE_EXPERT_TILE_ROWS}
    y = _grouped_gemm_quant(flat, one_expert(weight), _single_expert_sizes(count, data.device), batch_invariant,
                            op="linear", tcgen05=options.tcgen05, schedules=schedules,
                            native=options.quant_gemm == "native")
    return y.reshape(*data.shape[:-1], y.shape[-1])


@functools.lru_cache(maxsize=512)
def _single_expert_sizes(rows: int, device: torch.device) -> torch.Tensor:
    """int64 ``[1]`` holding ``rows``: the segment sizes of one expert (made on ``device`` once)."""
    return torch.full((1,), rows, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=512)
def _single_expert_schedule(rows: int, block_m: int, device: torch.device) -> torch.Tensor:
    """:func:`tile_schedule` of one expert holding all ``rows`` (made on ``device`` directly)."""
    first = torch.arange(0, rows, block_m, dtype=torch.int32, device=device)
    return torch.stack((torch.zeros_like(first), first, torch.full_like(first, rows)))

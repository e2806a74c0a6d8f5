"""sm100 grouped GEMM (HAL ``grouped_gemm``; :mod:`.linear` runs on it with one expert): bf16
operands on the TMA + wgmma kernels (for few rows per expert a Triton kernel that streams the
weights), block-scaled FP8 / MXFP4 operands on the decode-to-bf16 kernels (each warp-specialised
on Hopper, and for few rows per expert the register-decode ``mma.sync`` kernel). Tiles are picked
from the shape, or fixed in the batch-invariant mode."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.grouped_gemm import check_grouped_out_dtype
from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.fp8_scales import BLOCK_M
from deepinfer_backends.sm100.launch import compiled, cuda_bf16, on_device, require
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions

INVARIANT_TILES = {"block_m": 64, "block_n": 128, "threads": 128}
"""GEMM tiles of the batch-invariant mode: one shape whatever the row count (each output element
is then the same wgmma sequence over K, in order)."""


def grouped_gemm(x, weight, group_sizes: torch.Tensor, out_dtype: torch.dtype | None = None,
                 batch_invariant: bool = False, options: KernelOptions = DEFAULT,
                 schedules: dict | None = None) -> torch.Tensor:
    """``y[seg e] = x[seg e] @ weight[e].T`` (HAL ``grouped_gemm``): bf16 operands (bf16 result), or
    a Quantized weight (``"fp8"`` / ``"mxfp4"``) beside a bf16 or ``"fp8"`` x (float32 result, or
    bf16 for ``out_dtype=torch.bfloat16``; see :func:`_grouped_gemm_quant`). ``group_sizes`` must
    sum to ``M`` (not checked on the device: that would cost a host sync). ``batch_invariant``
    fixes the tiles (:data:`INVARIANT_TILES`); there is never a split over K. ``options.tcgen05``
    picks the Blackwell variant of the bf16 kernel.
    Otherwise bf16 operands with at most :data:`SKINNY_BF16_ROWS_PER_EXPERT` rows per expert on
    average take :mod:`.fused.grouped_gemm_skinny` (with few experts, no schedule launch). Calls on
    the same ``group_sizes`` share one tile schedule launch (:func:`shared_schedule`), or those
    sharing ``schedules`` when given."""
    op = "grouped_gemm"
    out_dtype = check_grouped_out_dtype(x, weight, out_dtype)
    if isinstance(x, Quantized) or isinstance(weight, Quantized):
        return _grouped_gemm_quant(x, weight, group_sizes, batch_invariant, tcgen05=options.tcgen05,
                                   schedules=schedules, native=options.quant_gemm == "native", out_dtype=out_dtype)
    cuda_bf16(op, "x", x)
    cuda_bf16(op, "weight", weight)
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm expects x [M, K] and weight [E, N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if group_sizes.dtype != torch.int64 or tuple(group_sizes.shape) != (weight.shape[0],):
        raise ValueError(f"group_sizes must be int64 [{weight.shape[0]}], got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    require(x.shape[1] % 8 == 0, op, f"K={x.shape[1]} must be a multiple of 8 (16-byte rows for TMA)")
    x, weight = x.contiguous(), weight.contiguous()
    few_rows = x.shape[0] <= SKINNY_BF16_ROWS_PER_EXPERT * weight.shape[0]
    if few_rows and not batch_invariant and not options.tcgen05:
        return grouped_gemm_few_rows(x, weight, group_sizes)
    module, factory, tiles = bf16_kernel(x.shape[0], *weight.shape, toolchain.device_arch(x.device.index or 0),
                                         batch_invariant, tcgen05=options.tcgen05)
    y = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        schedule = shared_schedule(group_sizes, x.shape[0], tiles["block_m"], x.device, schedules)
        kernel = compiled(module, factory, *weight.shape, **tiles)
        kernel(x, weight, schedule[0], schedule[1], schedule[2], y)
    return y


def shared_schedule(group_sizes: torch.Tensor, rows: int, tile_rows: int, device: torch.device,
                    schedules: dict | None = None) -> torch.Tensor:
    """The tile schedule of ``group_sizes`` over ``rows`` in tiles of ``tile_rows``, made once per
    ``group_sizes`` tensor: kept in ``schedules`` (``(rows, tile_rows)`` -> schedule) when the
    caller passes one, else beside the tensor (:func:`_schedules_of`), so the MoE layer's grouped
    GEMMs over the same dispatched rows share one schedule launch."""
    if schedules is None:
        schedules = _schedules_of(group_sizes)
    key = (rows, tile_rows)
    if key in schedules:
        return schedules[key]
    group_sizes = group_sizes.to(device)
    if on_device(group_sizes) and group_sizes.shape[0]:
        from deepinfer_backends.sm100.fused.tile_schedule import tile_schedule

        schedule = tile_schedule(group_sizes, rows, tile_rows)
    else:
        from deepinfer.hal.ops.grouped_gemm import tile_bounds

        schedule = torch.stack(tile_bounds(group_sizes, rows, tile_rows)).to(torch.int32)
    schedules[key] = schedule
    return schedule


def _schedules_of(group_sizes: torch.Tensor) -> dict:
    """The schedules made for ``group_sizes``, held as an attribute of the tensor (they go with
    it) and dropped when it has been written in place since (its version counter moved; inference
    tensors have none, and are not written after dispatch)."""
    try:
        version = group_sizes._version
    except RuntimeError:
        version = None
    held = getattr(group_sizes, "_tile_schedules", None)
    if held is None or held[0] != version:
        held = (version, {})
        group_sizes._tile_schedules = held
    return held[1]


SKINNY_BF16_ROWS_PER_EXPERT = 4
"""Rows per expert (on average) up to which bf16 ``grouped_gemm`` takes the Triton kernel for few
rows, which streams the weights through many narrow column blocks; above it the warp-specialised
kernel's 64-row tiles keep up or lead (``experiments/grouped_gemm_kernels.py``, the ``small``
points; ``experiments/results/grouped_gemm_skinny_h200.csv``)."""


def grouped_gemm_few_rows(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor,
                          up: torch.Tensor | None = None, limit: float | None = None,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """bf16 ``grouped_gemm`` of contiguous operands by the Triton kernel for few rows per expert
    (:mod:`.fused.grouped_gemm_skinny`); with ``up`` the SwiGLU of the products with ``weight``
    (gate) and ``up`` (``grouped_swiglu``), in ``dtype`` (default ``x.dtype``)."""
    from deepinfer_backends.sm100.fused.grouped_gemm_skinny import BLOCK_T, SCHEDULE_IN_KERNEL, grouped_gemm_skinny

    y = torch.empty(x.shape[0], weight.shape[1], dtype=dtype or x.dtype, device=x.device)
    if x.shape[0]:
        few_experts = weight.shape[0] <= SCHEDULE_IN_KERNEL and on_device(group_sizes)
        schedule = group_sizes.contiguous() if few_experts else shared_schedule(group_sizes, x.shape[0], BLOCK_T,
                                                                                x.device)
        grouped_gemm_skinny(x, weight, schedule, y, up=up, limit=limit)
    return y


WS_STAGES = 4
"""Ring depth of the warp-specialised bf16 grouped GEMM (4 beat 3 on every MoE shape measured,
``experiments/results/grouped_gemm_kernels_h200.csv``)."""


def bf16_kernel(rows: int, experts: int, n: int, k: int, arch: str, batch_invariant: bool = False,
                tcgen05: bool = False) -> tuple[str, str, dict[str, int]]:
    """``(kernels module, factory, tiles)`` of the bf16 grouped GEMM on ``arch``. On Hopper: the
    warp-specialised kernel (``grouped_gemm_ws``: faster than the portable one on the MoE
    shapes, mostly by skipping the idle warpgroup of a segment's short last tile); in the batch-invariant
    mode, on other archs, or with ``tcgen05`` the portable kernel (or its tcgen05 variant,
    :func:`toolchain.kernel_module`) with :func:`gemm_tiles`."""
    tiles = gemm_tiles(rows, experts, n, k, batch_invariant=batch_invariant)
    if arch == toolchain.HOPPER and not batch_invariant and not tcgen05:
        return "grouped_gemm_ws", "grouped_gemm_bf16_ws", {"block_m": tiles["block_m"],
                                                            "block_n": 256 if n >= 256 else 128,
                                                            "num_stages": WS_STAGES}
    return toolchain.kernel_module("grouped_gemm", "grouped_gemm", tcgen05), "grouped_gemm_bf16", tiles


QUANT_BLOCK_K = 128
QUANT_MAX_K = 8192
"""K block of the block-scaled grouped GEMM, and its largest K (each CTA keeps its rows' scale
bytes for the whole K in shared memory)."""


def _grouped_gemm_quant(x, weight, group_sizes: torch.Tensor, batch_invariant: bool,
                        op: str = "grouped_gemm", tcgen05: bool = False,
                        schedules: dict | None = None, native: bool = False,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``grouped_gemm`` with block-scaled operands: bf16 or ``"fp8"`` x, ``"fp8"`` or ``"mxfp4"``
    weight, UE8M0 scales per 32 along K. Decoded exactly to bf16 in the kernel; float32 result,
    like the reference, rounded to ``out_dtype`` (in the native kernel's epilogue, else by a cast).
    ``native`` (``quant_gemm=native``) takes the FP8 tensor cores where
    :func:`~.grouped_gemm_native.native_fits` says so."""
    from deepinfer.hal.ops.grouped_gemm import logical_shape

    require(isinstance(weight, Quantized) and weight.fmt in ("fp8", "mxfp4") and weight.block == 32, op,
             f"the block-scaled kernel takes a weight Quantized 'fp8' or 'mxfp4' with block 32, got "
             f"{_operand_kind(weight)}")
    require(not isinstance(x, Quantized) or (x.fmt == "fp8" and x.block == 32), op,
             f"x must be bfloat16 or Quantized 'fp8' with block 32, got {_operand_kind(x)}")
    if not isinstance(x, Quantized):
        cuda_bf16(op, "x", x)
    x_shape, w_shape = logical_shape(x, "x", ("fp8",)), logical_shape(weight, "weight", ("fp8", "mxfp4"))
    if len(x_shape) != 2 or len(w_shape) != 3 or w_shape[2] != x_shape[1]:
        raise ValueError(f"grouped_gemm expects x [M, K] and weight [E, N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    if group_sizes.dtype != torch.int64 or tuple(group_sizes.shape) != (w_shape[0],):
        raise ValueError(f"group_sizes must be int64 [{w_shape[0]}], got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    rows, k = x_shape
    require(k % QUANT_BLOCK_K == 0, op, f"K={k} must be a multiple of {QUANT_BLOCK_K} for the block-scaled kernel")
    if native:
        from deepinfer_backends.sm100.grouped_gemm_native import grouped_gemm_native, native_fits

        arch = toolchain.device_arch(x.data.device.index or 0) if isinstance(x, Quantized) and x.data.is_cuda else ""
        if native_fits(x, rows, w_shape[0], k, arch, batch_invariant, tcgen05):
            return grouped_gemm_native(x, weight, group_sizes, op, schedules, out_dtype)
    if k > QUANT_MAX_K:
        return _split_k(x, weight, group_sizes, batch_invariant, op, tcgen05, schedules).to(out_dtype)
    x_data, x_scale = (x.data, x.scale) if isinstance(x, Quantized) else (x, None)
    tensors = [t for t in (x_data, x_scale, weight.data, weight.scale) if t is not None]
    require(all(t.is_cuda for t in tensors), op,
             f"operands must be CUDA tensors, got {[str(t.device) for t in tensors]}")
    require(all(t.dtype == torch.uint8 for t in (x_scale, weight.scale) if t is not None), op,
             "scales must be uint8 (UE8M0 bytes)")
    module, factory, tiles = quant_kernel(rows, *w_shape, toolchain.device_arch(x_data.device.index or 0),
                                          batch_invariant, weight.fmt, tcgen05)
    y = torch.empty(rows, w_shape[1], dtype=torch.float32, device=x_data.device)
    if rows:
        schedule = shared_schedule(group_sizes, rows, tiles.get("block_m") or tiles["block_t"], x_data.device,
                                   schedules)
        if module == "grouped_gemm_quant_skinny":
            run_quant_skinny(x_data.contiguous(), x_scale, weight.data.contiguous(), weight.scale.contiguous(),
                             schedule, y, weight.fmt, tiles)
        elif module == "grouped_gemm_quant_ws":
            run_quant_ws(x_data.contiguous(), x_scale, weight.data.contiguous(), weight.scale.contiguous(), schedule, y,
                         weight.fmt, tiles)
        else:
            if x_scale is None:  # bf16 x: the kernel leaves x_scale unread
                x_scale = torch.zeros(1, k // 32, dtype=torch.uint8, device=x_data.device)
            kernel = compiled(module, factory, *w_shape, "fp8" if isinstance(x, Quantized) else "bf16", weight.fmt,
                              **tiles)
            kernel(x_data.contiguous(), x_scale.contiguous(), weight.data.contiguous(), weight.scale.contiguous(),
                   schedule[0], schedule[1], schedule[2], y)
    return y.to(out_dtype)


def _split_k(x, weight, group_sizes: torch.Tensor, batch_invariant: bool, op: str, tcgen05: bool,
             schedules: dict) -> torch.Tensor:
    """The block-scaled GEMM over K beyond :data:`QUANT_MAX_K`: K cut into equal pieces (whole
    K blocks, at most that long each), their float32 products added in order (one tile schedule
    for all). Each weight piece is copied to a contiguous tensor per call."""
    k = x.data.shape[-1] if isinstance(x, Quantized) else x.shape[-1]
    blocks = k // QUANT_BLOCK_K
    pieces = -(-k // QUANT_MAX_K)
    y = None
    for piece in range(pieces):
        first, last = blocks * piece // pieces * QUANT_BLOCK_K, blocks * (piece + 1) // pieces * QUANT_BLOCK_K
        part = _grouped_gemm_quant(_k_slice(x, first, last), _k_slice(weight, first, last), group_sizes,
                                   batch_invariant, op, tcgen05, schedules)
        y = part if y is None else y.add_(part)
    return y


def _k_slice(operand, first: int, last: int):
    """Values ``first .. last - 1`` along K of a plain or Quantized operand, contiguous."""
    if not isinstance(operand, Quantized):
        return operand[..., first:last].contiguous()
    per_byte = 2 if operand.fmt == "mxfp4" else 1
    return Quantized(operand.data[..., first // per_byte:last // per_byte].contiguous(),
                     operand.scale[..., first // operand.block:last // operand.block].contiguous(),
                     operand.fmt, operand.block)


def run_quant_ws(x, x_scale, w, w_scale, schedule: torch.Tensor, y: torch.Tensor, w_format: str,
                 tiles: dict[str, int]) -> None:
    """Launch ``kernels/grouped_gemm_quant_ws.py`` into ``y``: FP8 activations (``x_scale`` given)
    are first decoded to bf16 by ``decode_fp8_rows`` (exact, once per row rather than once per
    output tile), bf16 ones go straight in."""
    k = w_scale.shape[2] * 32
    kernel = compiled("grouped_gemm_quant_ws", "grouped_gemm_quant_ws", w.shape[0], w.shape[1], k, w_format, **tiles)
    kernel(bf16_rows(x, x_scale), w, w_scale, schedule[0], schedule[1], schedule[2], y)


def run_quant_skinny(x, x_scale, w, w_scale, schedule: torch.Tensor, y: torch.Tensor, w_format: str,
                     tiles: dict[str, int], module: str = "grouped_gemm_quant_skinny") -> None:
    """Launch ``kernels/grouped_gemm_quant_skinny.py`` into ``y`` over a schedule of ``tiles["block_t"]``
    rows, FP8 activations decoded to bf16 first (:func:`bf16_rows`)."""
    compiled(module, "grouped_gemm_quant_skinny", w.shape[0], w.shape[1], x.shape[1], w_format, **tiles)(
        bf16_rows(x, x_scale), w, w_scale, *schedule, y)


def bf16_rows(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` itself if bf16, else its FP8 rows decoded exactly to bf16 by ``decode_fp8_rows`` (``k`` a
    multiple of 512), once for every output tile that reads them."""
    if x_scale is None:
        return x
    k = x.shape[1]
    decoded = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    compiled("grouped_gemm_quant_ws", "decode_fp8_rows", k, 128 if k % 2048 == 0 else 32)(x, x_scale.contiguous(),
                                                                                             decoded)
    return decoded


QUANT_WS_TILES = {128: {"num_stages": 3, "prefetch": "after"},
                  64: {"num_stages": 3, "decoders": 2, "prefetch": "before"}}
"""bf16 stages, decoder warpgroups and prefetch order of the warp-specialised block-scaled grouped
GEMM by ``block_m`` (raw stages: as many as fit; ``experiments/results/grouped_gemm_kernels_h200.txt``):
with 128-row tiles the consumers' accumulators leave registers for one decoder warpgroup only."""


SKINNY_ROWS_PER_EXPERT = 16
SKINNY_TILES = {"block_t": 8, "warps": 4, "depth": 2, "tiles_m": 2}
SKINNY_WIDE_TILES = {"fp8": {"block_t": 16, "warps": 4, "depth": 1, "tiles_m": 2},
                     "mxfp4": {"block_t": 16, "warps": 4, "depth": 2, "tiles_m": 2}}
"""Rows per expert (on average) up to which the block-scaled grouped GEMM takes the kernel for few
rows (``grouped_gemm_quant_skinny``: weights decoded in registers into ``mma.sync``, the rows on
the MMA's N side), and its tiles: 8-row tiles up to 4 rows per expert, 16-row tiles (by weight
format) above; two MMA tiles a warp (one read of the activations for 32 weight rows). The threshold
is where ``grouped_gemm_quant_ws`` overtakes it side by side, and each tile height is the faster one
for its range of rows (``experiments/results/grouped_gemm_kernels_h200.txt``; the ratios are in
``experiments/results/sm100_design_measurements_h200.md``)."""
SKINNY_MIN_CTAS = 2 * 132
"""With fewer CTAs than this (two per SM of an H200) at two MMA tiles a warp, the kernel for few rows
keeps one (twice the CTAs): a one-expert ``linear`` with a few thousand output columns would
otherwise leave most SMs idle (reasoned from the grid, not measured: the bench has no such point)."""


ONE_EXPERT_TILE_ROWS = tuple(sorted({SKINNY_TILES["block_t"], *(t["block_t"] for t in SKINNY_WIDE_TILES.values()),
                                      64, 128, BLOCK_M}))
"""Tile heights the block-scaled kernels cut rows into (the few-row kernel's, the 64- and 128-row
tiles of :func:`gemm_tiles`, the native kernel's ``BLOCK_M``): a one-expert ``linear`` has its
schedule for each made once per row count."""


def skinny_tiles(rows: int, experts: int, n: int, w_format: str) -> dict[str, int]:
    """Tiles of ``grouped_gemm_quant_skinny`` for ``rows`` over ``experts`` of ``n`` output columns:
    :data:`SKINNY_TILES` up to 4 rows per expert, else :data:`SKINNY_WIDE_TILES`; one MMA tile a
    warp where two would leave fewer than :data:`SKINNY_MIN_CTAS` CTAs."""
    tiles = dict(SKINNY_TILES if rows <= 4 * experts else SKINNY_WIDE_TILES[w_format])
    if experts * -(-n // (16 * tiles["warps"] * tiles["tiles_m"])) < SKINNY_MIN_CTAS:
        tiles["tiles_m"] = 1
    return tiles


def quant_kernel(rows: int, experts: int, n: int, k: int, arch: str, batch_invariant: bool = False,
                 w_format: str = "fp8", tcgen05: bool = False) -> tuple[str, str, dict[str, int]]:
    """``(kernels module, factory, tiles)`` of the block-scaled grouped GEMM on ``arch``. On Hopper,
    with ``k`` a multiple of 512: up to :data:`SKINNY_ROWS_PER_EXPERT` rows per expert on average the
    kernel for few rows (``grouped_gemm_quant_skinny``, tiles from :func:`skinny_tiles` by ``w_format``),
    else the warp-specialised kernel (``grouped_gemm_quant_ws``: a decoder warpgroup feeds the wgmmas
    a bf16 ring), 64- or 128-row tiles as for bf16. In the batch-invariant mode, with ``tcgen05``
    (which has no block-scaled variant), on other archs or for other ``k``: the portable kernel (decode, then wgmma, in the same warps) with
    :func:`portable_quant_tiles`."""
    if arch == toolchain.HOPPER and not batch_invariant and k % 512 == 0 and not tcgen05:
        if rows <= SKINNY_ROWS_PER_EXPERT * experts:
            return "grouped_gemm_quant_skinny", "grouped_gemm_quant_skinny", skinny_tiles(rows, experts, n, w_format)
        block_m = gemm_tiles(rows, experts, n, k)["block_m"]
        return "grouped_gemm_quant_ws", "grouped_gemm_quant_ws", {
            "block_m": block_m, "block_n": 256 if n >= 256 else 128, **QUANT_WS_TILES[block_m]}
    return "grouped_gemm_quant", "grouped_gemm_quant", portable_quant_tiles(rows, experts, n, k, batch_invariant)


def portable_quant_tiles(rows: int, experts: int, n: int, k: int, batch_invariant: bool = False) -> dict[str, int]:
    """Tiles of the portable block-scaled kernel: :func:`gemm_tiles`' rows, always 128 columns
    (shared memory), two consumer warpgroups (decode work) and :data:`QUANT_BLOCK_K`."""
    return {**gemm_tiles(rows, experts, n, k, batch_invariant=batch_invariant), "block_n": 128, "threads": 256,
            "block_k": QUANT_BLOCK_K}


def _operand_kind(operand) -> str:
    if isinstance(operand, Quantized):
        return f"Quantized {operand.fmt!r} with block {operand.block}"
    if isinstance(operand, torch.Tensor):
        return f"a {operand.dtype} tensor"
    return type(operand).__name__


def gemm_tiles(rows: int, experts: int, n: int, k: int, batch_invariant: bool = False) -> dict[str, int]:
    """Tile sizes: 64-row tiles when the average segment is short (decode), 128 otherwise; with
    ``batch_invariant`` always :data:`INVARIANT_TILES`, whatever the row count."""
    if batch_invariant:
        return dict(INVARIANT_TILES)
    block_m = 64 if rows < 64 * experts else 128
    block_n = 256 if n >= 256 and block_m == 128 else 128
    return {"block_m": block_m, "block_n": block_n, "threads": 256 if block_m == 128 else 128}

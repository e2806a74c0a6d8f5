"""Dense and grouped (per-expert) GEMMs, ``y = x @ weight.T``, with plain or block-quantized operands.

Quantized operands are :class:`~deepinfer.hal.formats.Quantized` with blocks of 32 along K and
UE8M0 scales: activations ``"fp8"`` (e4m3), weights ``"fp8"`` or ``"mxfp4"`` (packed e2m1, two
values per byte). They are dequantized exactly, so the only rounding is the float32 accumulation.
"""
from __future__ import annotations

import torch

from deepinfer.hal.formats import Quantized, quantize
from deepinfer.hal.spec import FLOAT32_OUTPUT, OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

Operand = torch.Tensor | Quantized

BLOCK = 32
ACTIVATION_FORMATS = ("fp8",)
WEIGHT_FORMATS = ("fp8", "mxfp4")
_DATA_DTYPES = {"fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}


def linear(x: Operand, weight: Operand, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y[..., N] = x[..., K] @ weight[N, K].T``, accumulated in float32.

    Plain tensors give a result in ``x.dtype``. If either operand is :class:`Quantized` (``x``:
    ``"fp8"`` data ``[..., K]``, scale ``[..., K/32]``; ``weight``: ``"fp8"`` data ``[N, K]`` or
    ``"mxfp4"`` data ``uint8 [N, K/2]``, scale ``[N, K/32]``) it is dequantized exactly and the
    result is float32. ``out_dtype=torch.float32`` writes the float32 accumulator as it is, with
    no rounding to ``x.dtype`` on the way: the LM head's logits, as DeepInfer's bf16 GEMM writes
    them."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    w_shape = logical_shape(weight, "weight", WEIGHT_FORMATS)
    if len(x_shape) < 1 or len(w_shape) != 2 or w_shape[1] != x_shape[-1]:
        raise ValueError(f"linear expects x [..., K] and weight [N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    check_out_dtype("linear", out_dtype)
    return (values(x) @ values(weight).T).to(out_dtype or result_dtype(x, weight))


def grouped_gemm(x: Operand, weight: Operand, group_sizes: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-expert GEMMs over contiguous row segments: ``y[seg e] = x[seg e] @ weight[e].T``.

    ``x [M, K]``, ``weight [E, N, K]``, ``group_sizes int64 [E]`` (non-negative, summing to at most
    ``M``): segment ``e`` is the next ``group_sizes[e]`` rows, in expert order; empty segments are
    allowed. Rows after the last segment are not computed (zero here; a backend may leave
    anything in them). float32 accumulation; result ``[M, N]`` in ``x.dtype`` for plain operands,
    float32 if either is :class:`Quantized` (``x``: ``"fp8"`` data ``[M, K]``, scale ``[M, K/32]``;
    ``weight``: ``"fp8"`` data ``[E, N, K]`` or ``"mxfp4"`` data ``uint8 [E, N, K/2]``, scale
    ``[E, N, K/32]``). With a quantized operand, ``out_dtype=torch.bfloat16`` rounds the float32
    result to bf16 once (DeepInfer's down projection writes bf16 for its combine); see
    :func:`check_grouped_out_dtype`. ``group_sizes`` is never read on the host (see
    :func:`grouped_gemm_tiled`)."""
    check_grouped_gemm(x, weight, group_sizes)
    out_dtype = check_grouped_out_dtype(x, weight, out_dtype)
    rows, experts = logical_shape(x, "x", ACTIVATION_FORMATS)[0], group_sizes.shape[0]
    tile_rows = max(1, -(-rows // max(experts, 1)))
    x_values = values(x)
    out = grouped_gemm_tiled(x_values, weight, group_sizes, tile_rows, lambda rows, w: rows @ values(w).T)
    return out.to(out_dtype)


def grouped_gemm_tiled(x: Operand, weight: Operand, group_sizes: torch.Tensor, tile_rows: int, gemm) -> torch.Tensor:
    """float32 ``[M, N]``: :func:`grouped_gemm` as a fixed number of tiles of ``tile_rows`` rows,
    each within one expert's segment, computed by ``gemm(x rows [tile_rows, K], expert weight)``.

    Tiles follow :func:`expert_tiles`, so no shape depends on ``group_sizes``; padding rows of a
    tile repeat a valid row and their results are dropped."""
    rows = _rows(x)
    n = logical_shape(weight, "weight", WEIGHT_FORMATS)[1]
    out = torch.zeros(rows + 1, n, dtype=torch.float32, device=group_sizes.device)
    if not rows:
        return out[:0]
    experts, tile_index, valid = expert_tiles(group_sizes, rows, tile_rows)
    scratch = torch.full_like(tile_index, rows)
    for tile in range(experts.shape[0]):
        result = gemm(_take_rows(x, tile_index[tile]), expert_weight(weight, experts[tile:tile + 1]))
        out.index_copy_(0, torch.where(valid[tile], tile_index[tile], scratch[tile]), result.float())
    return out[:rows]


def tile_bounds(group_sizes: torch.Tensor, num_rows: int, tile_rows: int):
    """Tiles of ``tile_rows`` rows over the expert segments: ``(expert, first row, end row)``,
    int64 ``[n]`` each, ``n = ceil(num_rows / tile_rows) + E`` (an upper bound on the tiles any
    sizes need), computed on the sizes' device without a host read. A tile starts at its
    segment's start plus a multiple of ``tile_rows``; an unused tile has expert ``E``."""
    experts = group_sizes.shape[0]
    sizes = group_sizes.to(torch.int64)
    ends = torch.cumsum(sizes, 0)
    tiles_per = (sizes + tile_rows - 1) // tile_rows
    tile_ends = torch.cumsum(tiles_per, 0)
    tile = torch.arange(-(-num_rows // tile_rows) + experts, device=sizes.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)
    safe = expert.clamp(max=max(experts - 1, 0))
    first = ends[safe] - sizes[safe] + (tile - tile_ends[safe] + tiles_per[safe]) * tile_rows
    return expert, first, ends[safe]


def expert_tiles(group_sizes: torch.Tensor, num_rows: int, tile_rows: int):
    """The tiles of :func:`tile_bounds` as ``(expert int64 [n], rows int64 [n, tile_rows],
    valid bool [n, tile_rows])``: rows past the segment (or of unused tiles) are invalid and
    clamped into range, and unused tiles name the last expert."""
    experts = group_sizes.shape[0]
    expert, first, end = tile_bounds(group_sizes, num_rows, tile_rows)
    rows = first[:, None] + torch.arange(tile_rows, device=first.device)
    valid = (expert < experts)[:, None] & (rows < end[:, None])
    return expert.clamp(max=max(experts - 1, 0)), rows.clamp(0, max(num_rows - 1, 0)), valid


def check_grouped_gemm(x: Operand, weight: Operand, group_sizes: torch.Tensor) -> None:
    """Check :func:`grouped_gemm`'s operands (the sizes' values only when value checks are on)."""
    x_shape = logical_shape(x, "x", ACTIVATION_FORMATS)
    w_shape = logical_shape(weight, "weight", WEIGHT_FORMATS)
    if len(x_shape) != 2 or len(w_shape) != 3 or w_shape[2] != x_shape[1]:
        raise ValueError(f"grouped_gemm expects x [M, K] and weight [E, N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    _check_segment_sizes(group_sizes, num_experts=w_shape[0], num_rows=x_shape[0])


def logical_shape(operand: Operand, name: str, formats: tuple[str, ...]) -> torch.Size:
    """Shape of the values ``operand`` holds (checks a :class:`Quantized` operand's layout)."""
    if isinstance(operand, torch.Tensor):
        return operand.shape
    if not isinstance(operand, Quantized):
        raise ValueError(f"{name} must be a Tensor or Quantized, got {type(operand).__name__}")
    if operand.fmt not in formats or operand.block != BLOCK:
        raise ValueError(f"{name} is Quantized {operand.fmt!r} with block {operand.block}; "
                         f"expected one of {formats} with block {BLOCK}")
    data = operand.data
    if data.dtype != _DATA_DTYPES[operand.fmt]:
        raise ValueError(f"{name}.data is {data.dtype}; {operand.fmt!r} stores {_DATA_DTYPES[operand.fmt]}")
    k = data.shape[-1] * (2 if operand.fmt == "mxfp4" else 1)
    scale_shape = (*data.shape[:-1], k // BLOCK)
    if k % BLOCK or tuple(operand.scale.shape) != scale_shape:
        raise ValueError(f"{name}: K={k} with scale {tuple(operand.scale.shape)}; expected K a multiple "
                         f"of {BLOCK} and scale {scale_shape} (one UE8M0 byte per {BLOCK} along K)")
    return torch.Size((*data.shape[:-1], k))


def values(operand: Operand) -> torch.Tensor:
    """float32 values of a plain or :class:`Quantized` operand."""
    return operand.dequantize() if isinstance(operand, Quantized) else operand.float()


def expert_weight(weight: Operand, expert: int | torch.Tensor) -> Operand:
    """Expert ``expert``'s ``[N, K]`` slice of an ``[E, N, K]`` weight; ``expert`` an int or an
    int64 tensor of one element (selected on the device, without a host read)."""
    if isinstance(expert, torch.Tensor):
        if isinstance(weight, Quantized):
            return Quantized(weight.data.index_select(0, expert)[0], weight.scale.index_select(0, expert)[0],
                             weight.fmt, weight.block)
        return weight.index_select(0, expert)[0]
    if isinstance(weight, Quantized):
        return Quantized(weight.data[expert], weight.scale[expert], weight.fmt, weight.block)
    return weight[expert]


def result_dtype(x: Operand, weight: Operand) -> torch.dtype:
    """float32 when either operand is quantized, else ``x.dtype``."""
    quantized = isinstance(x, Quantized) or isinstance(weight, Quantized)
    return torch.float32 if quantized else x.dtype


def check_out_dtype(op: str, out_dtype: torch.dtype | None) -> None:
    """``out_dtype`` of a GEMM op: None (the operands' result dtype) or float32."""
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"{op}: out_dtype must be None (the result in x's dtype, float32 for quantized operands) "
                         f"or torch.float32 (the unrounded accumulator), got {out_dtype}")


def check_grouped_out_dtype(x: Operand, weight: Operand, out_dtype: torch.dtype | None) -> torch.dtype:
    """The result dtype of ``grouped_gemm(x, weight, ..., out_dtype)``: None gives the operands'
    (:func:`result_dtype`); with a quantized operand float32 or bfloat16 may be asked for, plain
    operands give ``x.dtype`` only."""
    quantized = isinstance(x, Quantized) or isinstance(weight, Quantized)
    allowed = (torch.float32, torch.bfloat16) if quantized else (x.dtype,)
    if out_dtype is not None and out_dtype not in allowed:
        raise ValueError(f"grouped_gemm: out_dtype must be None or one of {[str(d) for d in allowed]} for these "
                         f"operands (float32 or bfloat16 with a quantized operand, x's dtype for plain ones), "
                         f"got {out_dtype}")
    return out_dtype or result_dtype(x, weight)


def _check_segment_sizes(group_sizes: torch.Tensor, num_experts: int, num_rows: int) -> None:
    if (not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype != torch.int64
            or tuple(group_sizes.shape) != (num_experts,)):
        seen = (f"{group_sizes.dtype} {tuple(group_sizes.shape)}" if isinstance(group_sizes, torch.Tensor)
                else type(group_sizes).__name__)
        raise ValueError(f"group_sizes must be int64 [{num_experts}] (one count per expert), got {seen}")
    if value_checks():
        sizes = group_sizes.tolist()
        if min(sizes, default=0) < 0 or sum(sizes) > num_rows:
            raise ValueError(f"group_sizes {sizes} must be non-negative and sum to at most the {num_rows} rows of x")


def _rows(operand: Operand) -> int:
    return (operand.data if isinstance(operand, Quantized) else operand).shape[0]


def _take_rows(operand: Operand, rows: torch.Tensor) -> Operand:
    if isinstance(operand, Quantized):
        return Quantized(operand.data.index_select(0, rows), operand.scale.index_select(0, rows), operand.fmt,
                         operand.block)
    return operand.index_select(0, rows)


def _random_mxfp4(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> Quantized:
    """Random MXFP4 bytes (all 16 codes, scales 2^-7 .. 2^-4), as a checkpoint would hold them."""
    *lead, k = shape
    data = torch.randint(0, 256, (*lead, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(120, 124, (*lead, k // BLOCK), generator=gen, dtype=torch.uint8)
    return Quantized(data.to(device), scale.to(device), "mxfp4", BLOCK)


def _operand(shape, fmt, gen, device, dtype=torch.float32, spread=1.0) -> Operand:
    if fmt == "mxfp4":
        return _random_mxfp4(shape, gen, device)
    plain = (spread * torch.randn(*shape, generator=gen, dtype=dtype)).to(device)
    return quantize(plain, fmt, BLOCK) if fmt else plain


def _linear_case(lead, n, k, x_fmt=None, w_fmt=None, dtype=torch.float32, out_dtype=None):
    def make(gen: torch.Generator, device: torch.device):
        args = {"x": _operand((*lead, k), x_fmt, gen, device, dtype),
                "weight": _operand((n, k), w_fmt, gen, device, dtype, spread=k ** -0.5)}
        return args if out_dtype is None else {**args, "out_dtype": out_dtype}
    return make


def _grouped_case(sizes, n, k, x_fmt=None, w_fmt=None, dtype=torch.float32, out_dtype=None):
    def make(gen: torch.Generator, device: torch.device):
        args = {"x": _operand((sum(sizes), k), x_fmt, gen, device, dtype),
                "weight": _operand((len(sizes), n, k), w_fmt, gen, device, dtype, spread=k ** -0.5),
                "group_sizes": torch.tensor(sizes, dtype=torch.int64, device=device)}
        return args if out_dtype is None else {**args, "out_dtype": out_dtype}
    return make


register(OpSpec(
    name="linear",
    summary="y = x @ weight.T (float32 accumulation; FP8 / MXFP4 operands dequantized exactly)",
    reference=linear,
    cases=(
        OpCase("tiny", _linear_case((2, 3), 16, 64)),
        OpCase("tiny_bf16", _linear_case((5,), 24, 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("decode_bf16", _linear_case((1, 3), 64, 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_fp8_fp8", _linear_case((4,), 16, 64, "fp8", "fp8")),
        OpCase("tiny_bf16_x_fp8_weight", _linear_case((4,), 16, 64, None, "fp8", torch.bfloat16)),
        OpCase("tiny_fp8_mxfp4", _linear_case((3,), 8, 128, "fp8", "mxfp4")),
        OpCase("v41_q_a_bf16", _linear_case((32,), 1280, 4096, dtype=torch.bfloat16), "real", torch.bfloat16),
        OpCase("v41_q_a_fp8", _linear_case((32,), 1280, 4096, "fp8", "fp8"), "real"),
        # quantized operands beside bf16 activations (the cases bf16-only backends run); K a multiple of 128
        OpCase("bf16_x_fp8_weight", _linear_case((2, 3), 24, 128, None, "fp8", torch.bfloat16), dtype=torch.bfloat16),
        OpCase("fp8_mxfp4_bf16", _linear_case((5,), 40, 256, "fp8", "mxfp4", torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_q_a_fp8_bf16", _linear_case((32,), 1280, 4096, "fp8", "fp8", torch.bfloat16), "real",
               torch.bfloat16),
        # float32 logits of bf16 operands, held to float32's tolerance: a result rounded to bf16 fails
        OpCase("head_float32_bf16", _linear_case((3,), 96, 256, dtype=torch.bfloat16, out_dtype=torch.float32),
               dtype=torch.bfloat16, tolerance=FLOAT32_OUTPUT),
        OpCase("rows_head_float32_bf16", _linear_case((40,), 160, 512, dtype=torch.bfloat16, out_dtype=torch.float32),
               dtype=torch.bfloat16, tolerance=FLOAT32_OUTPUT),
        OpCase("v41_head_float32_bf16", _linear_case((16,), 8192, 4096, dtype=torch.bfloat16,
                                                     out_dtype=torch.float32), "real", torch.bfloat16, FLOAT32_OUTPUT),
    ),
))

register(OpSpec(
    name="grouped_gemm",
    summary="per-expert GEMMs over contiguous row segments (bf16, FP8 x FP8, FP8 x MXFP4)",
    reference=grouped_gemm,
    cases=(
        OpCase("tiny", _grouped_case((3, 1, 4), 16, 64)),
        OpCase("tiny_bf16", _grouped_case((2, 5), 24, 96, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_fp8_fp8", _grouped_case((2, 3, 1), 16, 64, "fp8", "fp8")),
        OpCase("tiny_fp8_mxfp4", _grouped_case((4, 2), 8, 128, "fp8", "mxfp4")),
        OpCase("empty_experts", _grouped_case((0, 3, 0, 0, 2, 0), 16, 64, "fp8", "mxfp4")),
        OpCase("no_rows", _grouped_case((0, 0), 16, 64)),
        OpCase("empty_experts_bf16", _grouped_case((0, 3, 0, 0, 70, 0), 40, 64, dtype=torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("v41_experts_bf16", _grouped_case((20, 0, 31, 13), 2048, 4096, dtype=torch.bfloat16),
               "real", torch.bfloat16),
        OpCase("v41_experts_fp8_mxfp4", _grouped_case((9, 27, 0, 28), 2048, 4096, "fp8", "mxfp4"), "real"),
        # quantized operands beside bf16 activations (the cases bf16-only backends run); K a multiple of 128
        OpCase("bf16_x_fp8_weight", _grouped_case((3, 0, 5), 24, 128, None, "fp8", torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("bf16_x_mxfp4_weight", _grouped_case((2, 7), 40, 256, None, "mxfp4", torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("fp8_fp8_bf16", _grouped_case((2, 3, 1), 16, 256, "fp8", "fp8", torch.bfloat16), dtype=torch.bfloat16),
        OpCase("fp8_mxfp4_empty_experts_bf16", _grouped_case((0, 3, 0, 0, 70, 0), 40, 128, "fp8", "mxfp4",
                                                             torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41_experts_bf16_x_fp8_weight", _grouped_case((20, 0, 31, 13), 2048, 4096, None, "fp8",
                                                              torch.bfloat16), "real", torch.bfloat16),
        OpCase("v41_experts_fp8_mxfp4_bf16", _grouped_case((9, 27, 0, 28), 2048, 4096, "fp8", "mxfp4",
                                                           torch.bfloat16), "real", torch.bfloat16),
        # the float32 result rounded to bf16 (the MoE's down projection)
        OpCase("fp8_fp8_bf16_out", _grouped_case((2, 3, 1), 16, 256, "fp8", "fp8", torch.bfloat16, torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("fp8_mxfp4_bf16_out", _grouped_case((0, 3, 0, 70), 40, 128, "fp8", "mxfp4", torch.bfloat16,
                                                   torch.bfloat16), dtype=torch.bfloat16),
        OpCase("fp8_fp8_float32_out", _grouped_case((2, 3, 1), 16, 256, "fp8", "fp8", torch.bfloat16, torch.float32),
               dtype=torch.bfloat16, tolerance=FLOAT32_OUTPUT),
        OpCase("v41_down_fp8_mxfp4_bf16_out", _grouped_case((9, 27, 0, 28), 4096, 2048, "fp8", "mxfp4",
                                                            torch.bfloat16, torch.bfloat16), "real", torch.bfloat16),
    ),
))

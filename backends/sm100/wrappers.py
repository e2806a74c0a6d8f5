"""HAL-signature wrappers around the TileLang kernels: check layouts, prepare kernel inputs, pick
tile sizes, and keep one compiled kernel per shape key (the first call for a shape compiles;
TileLang's disk cache makes later processes fast). ``tilelang`` is imported on first use."""
from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer.hal.formats import Quantized, token_format
from deepinfer.hal.ops.kv_cache import cache_rows
from deepinfer_backends.sm100 import toolchain

_COMPILED: dict[tuple, Any] = {}
HEAD_BLOCK = 64
INVARIANT_TILES = {"block_m": 64, "block_n": 128, "threads": 128}
"""GEMM tiles of the batch-invariant mode: one shape whatever the row count (each output element
is then the same wgmma sequence over K, in order)."""


def compiled(module: str, factory: str, *args, **kwargs):
    """The kernel ``kernels.<module>.<factory>(*args, **kwargs)``, compiled for this GPU once."""
    key = (module, factory, args, tuple(sorted(kwargs.items())))
    if key not in _COMPILED:
        import tilelang

        jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
        _COMPILED[key] = tilelang.compile(jit.get_tir(*args, **kwargs), target=toolchain.target(toolchain.device_arch()),
                                          pass_configs=jit.pass_configs)
    return _COMPILED[key]


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise UnsupportedInput(f"sm100 {op}: {message}; set backend.fallback=reference to run such calls on the "
                               f"reference backend, or run the op there always (+backend.overrides.{op}=reference)")


def _cuda_bf16(op: str, name: str, t: torch.Tensor) -> None:
    _require(isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.bfloat16, op,
             f"{name} must be a bfloat16 CUDA tensor, got "
             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} on "
             f"{t.device if isinstance(t, torch.Tensor) else '-'}")


def grouped_gemm(x, weight, group_sizes: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``y[seg e] = x[seg e] @ weight[e].T`` (HAL ``grouped_gemm``): bf16 operands (bf16 result), or
    a Quantized weight (``"fp8"`` / ``"mxfp4"``) beside a bf16 or ``"fp8"`` x (float32 result, see
    :func:`_grouped_gemm_quant`). ``group_sizes`` must sum to ``M`` (not checked on the device:
    that would cost a host sync). ``batch_invariant`` fixes the tiles (:data:`INVARIANT_TILES`);
    there is never a split over K."""
    op = "grouped_gemm"
    if isinstance(x, Quantized) or isinstance(weight, Quantized):
        return _grouped_gemm_quant(x, weight, group_sizes, batch_invariant)
    _cuda_bf16(op, "x", x)
    _cuda_bf16(op, "weight", weight)
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm expects x [M, K] and weight [E, N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if group_sizes.dtype != torch.int64 or tuple(group_sizes.shape) != (weight.shape[0],):
        raise ValueError(f"group_sizes must be int64 [{weight.shape[0]}], got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    _require(x.shape[1] % 8 == 0, op, f"K={x.shape[1]} must be a multiple of 8 (16-byte rows for TMA)")
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

    x, weight = x.contiguous(), weight.contiguous()
    tiles = gemm_tiles(x.shape[0], *weight.shape, batch_invariant=batch_invariant)
    module = toolchain.kernel_module(op, "grouped_gemm")  # the tcgen05 variant only with DEEPINFER_SM100_TCGEN05=1
    y = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        schedule = tile_schedule(group_sizes.to(x.device), x.shape[0], tiles["block_m"])
        kernel = compiled(module, "grouped_gemm_bf16", *weight.shape, **tiles)
        kernel(x, weight, schedule[0], schedule[1], schedule[2], y)
    return y


QUANT_BLOCK_K = 128
QUANT_MAX_K = 8192
"""K block of the block-scaled grouped GEMM, and its largest K (each CTA keeps its rows' scale
bytes for the whole K in shared memory)."""


def _grouped_gemm_quant(x, weight, group_sizes: torch.Tensor, batch_invariant: bool,
                        op: str = "grouped_gemm") -> torch.Tensor:
    """``grouped_gemm`` with block-scaled operands: bf16 or ``"fp8"`` x, ``"fp8"`` or ``"mxfp4"``
    weight, UE8M0 scales per 32 along K. Decoded exactly to bf16 in the kernel; float32 result,
    like the reference."""
    from deepinfer.hal.ops.grouped_gemm import logical_shape

    _require(isinstance(weight, Quantized) and weight.fmt in ("fp8", "mxfp4") and weight.block == 32, op,
             f"the block-scaled kernel takes a weight Quantized 'fp8' or 'mxfp4' with block 32, got "
             f"{_operand_kind(weight)}")
    _require(not isinstance(x, Quantized) or (x.fmt == "fp8" and x.block == 32), op,
             f"x must be bfloat16 or Quantized 'fp8' with block 32, got {_operand_kind(x)}")
    if not isinstance(x, Quantized):
        _cuda_bf16(op, "x", x)
    x_shape, w_shape = logical_shape(x, "x", ("fp8",)), logical_shape(weight, "weight", ("fp8", "mxfp4"))
    if len(x_shape) != 2 or len(w_shape) != 3 or w_shape[2] != x_shape[1]:
        raise ValueError(f"grouped_gemm expects x [M, K] and weight [E, N, K]; got x {tuple(x_shape)}, "
                         f"weight {tuple(w_shape)}")
    if group_sizes.dtype != torch.int64 or tuple(group_sizes.shape) != (w_shape[0],):
        raise ValueError(f"group_sizes must be int64 [{w_shape[0]}], got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    rows, k = x_shape
    _require(k % QUANT_BLOCK_K == 0 and k <= QUANT_MAX_K, op,
             f"K={k} must be a multiple of {QUANT_BLOCK_K} and at most {QUANT_MAX_K} for the block-scaled kernel")
    x_data, x_scale = (x.data, x.scale) if isinstance(x, Quantized) else (x, None)
    tensors = [t for t in (x_data, x_scale, weight.data, weight.scale) if t is not None]
    _require(all(t.is_cuda for t in tensors), op,
             f"operands must be CUDA tensors, got {[str(t.device) for t in tensors]}")
    _require(all(t.dtype == torch.uint8 for t in (x_scale, weight.scale) if t is not None), op,
             "scales must be uint8 (UE8M0 bytes)")
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

    if x_scale is None:  # bf16 x: the kernel leaves x_scale unread
        x_scale = torch.zeros(1, k // 32, dtype=torch.uint8, device=x_data.device)
    # 64- or 128-row tiles as for bf16; always 128 columns (shared memory) and two consumer warpgroups (decode work)
    tiles = {**gemm_tiles(rows, w_shape[0], w_shape[1], k, batch_invariant=batch_invariant), "block_n": 128,
             "threads": 256}
    y = torch.empty(rows, w_shape[1], dtype=torch.float32, device=x_data.device)
    if rows:
        schedule = tile_schedule(group_sizes.to(x_data.device), rows, tiles["block_m"])
        kernel = compiled("grouped_gemm_quant", "grouped_gemm_quant", *w_shape,
                          "fp8" if isinstance(x, Quantized) else "bf16", weight.fmt, block_k=QUANT_BLOCK_K, **tiles)
        kernel(x_data.contiguous(), x_scale.contiguous(), weight.data.contiguous(), weight.scale.contiguous(),
               schedule[0], schedule[1], schedule[2], y)
    return y


def _operand_kind(operand) -> str:
    if isinstance(operand, Quantized):
        return f"Quantized {operand.fmt!r} with block {operand.block}"
    if isinstance(operand, torch.Tensor):
        return f"a {operand.dtype} tensor"
    return type(operand).__name__


def linear(x, weight, batch_invariant: bool = False) -> torch.Tensor:
    """HAL ``linear``, ``y[..., N] = x[..., K] @ weight[N, K].T``: the grouped GEMM kernel with
    one expert (its tile schedule built once per row count, with no host sync)."""
    op = "linear"
    if isinstance(x, Quantized) or isinstance(weight, Quantized):
        return _linear_quant(x, weight, batch_invariant)
    _cuda_bf16(op, "x", x)
    _cuda_bf16(op, "weight", weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear expects x [..., K] and weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    _require(x.shape[-1] % 8 == 0, op, f"K={x.shape[-1]} must be a multiple of 8 (16-byte rows for TMA)")
    flat, weight = x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous()
    rows, n = flat.shape[0], weight.shape[0]
    tiles = gemm_tiles(rows, 1, n, weight.shape[1], batch_invariant=batch_invariant)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        schedule = _single_expert_schedule(rows, tiles["block_m"], x.device)
        kernel = compiled("grouped_gemm", "grouped_gemm_bf16", 1, *weight.shape, **tiles)
        kernel(flat, weight.unsqueeze(0), schedule[0], schedule[1], schedule[2], y)
    return y.reshape(*x.shape[:-1], n)


def _linear_quant(x, weight, batch_invariant: bool) -> torch.Tensor:
    """``linear`` with block-scaled operands: the block-scaled grouped GEMM with one expert."""
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
    sizes = torch.full((1,), count, dtype=torch.int64, device=data.device)
    y = _grouped_gemm_quant(flat, one_expert(weight), sizes, batch_invariant, op="linear")
    return y.reshape(*data.shape[:-1], y.shape[-1])


@functools.lru_cache(maxsize=512)
def _single_expert_schedule(rows: int, block_m: int, device: torch.device) -> torch.Tensor:
    """:func:`tile_schedule` of one expert holding all ``rows`` (made on ``device`` directly)."""
    first = torch.arange(0, rows, block_m, dtype=torch.int32, device=device)
    return torch.stack((torch.zeros_like(first), first, torch.full_like(first, rows)))


def gemm_tiles(rows: int, experts: int, n: int, k: int, batch_invariant: bool = False) -> dict[str, int]:
    """Tile sizes: 64-row tiles when the average segment is short (decode), 128 otherwise; with
    ``batch_invariant`` always :data:`INVARIANT_TILES`, whatever the row count."""
    if batch_invariant:
        return dict(INVARIANT_TILES)
    block_m = 64 if rows < 64 * experts else 128
    block_n = 256 if n >= 256 and block_m == 128 else 128
    return {"block_m": block_m, "block_n": block_n, "threads": 256 if block_m == 128 else 128}


def _check_indices(op: str, name: str, indices: torch.Tensor, leading: tuple[int, ...]) -> None:
    if indices.dtype != torch.int32 or tuple(indices.shape[:-1]) != leading or indices.dim() != len(leading) + 1:
        raise ValueError(f"{op}: {name} must be int32 [{', '.join(map(str, leading))}, K], got {indices.dtype} "
                         f"{tuple(indices.shape)}")


def _pad_heads(q: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [rows, h, D]`` and ``sink [h]`` padded to a multiple of the kernel's head block."""
    heads = q.shape[1]
    padded = -(-heads // HEAD_BLOCK) * HEAD_BLOCK
    if padded == heads:
        return q.contiguous(), sink.float().contiguous()
    q_pad = q.new_zeros(q.shape[0], padded, q.shape[2])
    q_pad[:, :heads] = q
    sink_pad = sink.new_zeros(padded, dtype=torch.float32)
    sink_pad[:heads] = sink
    return q_pad, sink_pad


def _attention(op: str, q, main, main_idx, extra, extra_idx, sink, scale: float, main_format: str,
               split_kv: bool):
    """Run ``sparse_mla`` on flat rows ``q [rows, h, D]``; returns ``(out [rows, h, D], lse)``."""
    rows, heads, dim = q.shape
    q_pad, sink_pad = _pad_heads(q, sink)
    padded = q_pad.shape[1]
    main_keys, extra_keys = main_idx.shape[1], (extra_idx.shape[1] if extra is not None else 0)
    if extra is None:
        extra = torch.zeros(1, token_format("fp4").bytes_per_token, dtype=torch.uint8, device=q.device)
        extra_idx = torch.full((rows, 1), -1, dtype=torch.int32, device=q.device)
    splits = split_count(rows * padded // HEAD_BLOCK, -(-main_keys // 64), -(-extra_keys // 64), q.device) \
        if split_kv else 1
    config = (padded, dim, main_keys, extra_keys, float(scale), main_format)
    module = toolchain.kernel_module(op, "mla_sparse_decode")  # decode only: prefill keeps the portable kernel
    out = torch.empty(rows, padded, dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(rows, padded, dtype=torch.float32, device=q.device)
    if rows:
        kernel = compiled(module, "sparse_mla", *config, splits=splits)
        if splits == 1:
            kernel(q_pad, main, main_idx.contiguous(), extra, extra_idx.contiguous(), sink_pad, out, lse)
        else:
            out_part = torch.empty(splits, rows, padded, dim, dtype=torch.float32, device=q.device)
            lse_part = torch.empty(splits, rows, padded, dtype=torch.float32, device=q.device)
            kernel(q_pad, main, main_idx.contiguous(), extra, extra_idx.contiguous(), sink_pad, out_part, lse_part)
            compiled("mla_sparse_decode", "combine", padded, dim, splits)(out_part, lse_part, sink_pad, out, lse)
    if padded == heads:
        return out, lse
    return out[:, :heads].contiguous(), lse[:, :heads].contiguous()


def split_count(ctas: int, main_blocks: int, extra_blocks: int, device: torch.device) -> int:
    """KV splits for ``ctas`` CTAs: the count (up to 16) that minimises waves x key blocks per
    split, where each split takes an equal, block-padded slice of both key lists."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def cost(splits: int) -> int:
        return -(-ctas * splits // sms) * (-(-main_blocks // splits) - (-extra_blocks // splits))

    return min(range(1, 17), key=lambda splits: (cost(splits), splits))


def mla_sparse_decode(q, cache, indices, sink, scale, cache_format="fp8", extra_cache=None, extra_indices=None,
                      extra_format="fp4", split_kv: bool = True):
    """HAL ``mla_sparse_decode`` on the tensor cores: bf16 ``q [B, s_q, h, 512]``, main cache ``fp8``
    (528 B) or ``bf16`` rows, optional ``fp4`` (288 B) extra cache beside an fp8 main cache. ``split_kv=False`` keeps one
    CTA per row (the batch-invariant order). Index values past the cache are treated as padding."""
    op = "mla_sparse_decode"
    _require(cache_format in ("fp8", "bf16"), op, f"main cache format {cache_format!r} is not implemented "
             f"(fp8 and bf16 are)")
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError(f"{op}: extra_cache and extra_indices go together")
    _require(extra_cache is None or (extra_format == "fp4" and cache_format == "fp8"), op,
             f"an extra cache in {extra_format!r} beside a {cache_format!r} main cache is not implemented "
             f"(fp4 beside fp8 is)")
    _cuda_bf16(op, "q", q)
    if q.dim() != 4 or q.shape[-1] != 512:
        raise ValueError(f"{op}: q must be [B, s_q, h, 512], got {tuple(q.shape)}")
    batch, s_q, heads, dim = q.shape
    rows = cache_rows(cache, token_format(cache_format))
    main = rows.view(torch.bfloat16) if cache_format == "bf16" else rows
    _check_indices(op, "indices", indices, (batch, s_q))
    extra = None
    if extra_cache is not None:
        _check_indices(op, "extra_indices", extra_indices, (batch, s_q))
        extra = cache_rows(extra_cache, token_format("fp4"))
        extra_indices = extra_indices.reshape(batch * s_q, -1)
    _check_sink(op, sink, heads)
    out, lse = _attention(op, q.reshape(batch * s_q, heads, dim), main, indices.reshape(batch * s_q, -1), extra,
                          extra_indices, sink, scale, cache_format, split_kv)
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def mla_sparse_prefill(q, kv, indices, sink, scale, main_keys: int | None = None, split_kv: bool = True):
    """HAL ``mla_sparse_prefill`` on the tensor cores: bf16 ``q [T, h, D]``, ``kv [S, D]``
    (D a multiple of 64, up to 512). With ``main_keys``, the main list is padded with ``-1`` to
    whole key blocks, as the decode kernel pads it, so both paths walk the same blocks."""
    op = "mla_sparse_prefill"
    _cuda_bf16(op, "q", q)
    _cuda_bf16(op, "kv", kv)
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: expects q [T, h, D] and kv [S, D]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}")
    _require(q.shape[2] % 64 == 0 and q.shape[2] <= 512, op, f"D={q.shape[2]} must be a multiple of 64 up to 512")
    _check_indices(op, "indices", indices, (q.shape[0],))
    _check_sink(op, sink, q.shape[1])
    if main_keys is not None and not (isinstance(main_keys, int) and 0 <= main_keys <= indices.shape[1]):
        raise ValueError(f"{op}: main_keys must be an int in [0, K={indices.shape[1]}], got {main_keys!r}")
    return _attention(op, q, kv.contiguous(), align_lists(indices, main_keys), None, None, sink, scale, "bf16",
                      split_kv)


def align_lists(indices: torch.Tensor, main_keys: int | None, block: int = 64) -> torch.Tensor:
    """``indices [T, K]`` with its first ``main_keys`` columns padded by ``-1`` to a multiple of
    ``block`` (the decode kernel's key block) when another list follows them."""
    pad = -(main_keys or 0) % block
    if main_keys is None or not pad or main_keys == indices.shape[1]:
        return indices
    filler = indices.new_full((indices.shape[0], pad), -1)
    return torch.cat((indices[:, :main_keys], filler, indices[:, main_keys:]), dim=1)


def _check_sink(op: str, sink: torch.Tensor, heads: int) -> None:
    if sink.shape != (heads,):
        raise ValueError(f"{op}: sink must be float32 [h={heads}], got {tuple(sink.shape)}")


def rms_norm(x, weight, eps, residual=None):
    """HAL ``rms_norm`` (+ residual): one CTA per row, float32 math, bf16 or float32 rows."""
    op = "rms_norm"
    _require(x.is_cuda and x.dim() >= 1, op, f"x must be a CUDA tensor, got {x.device}")
    dim = x.shape[-1]
    _require(dim % 32 == 0, op, f"the last dim ({dim}) must be a multiple of 32")
    if weight.shape != (dim,):
        raise ValueError(f"{op}: weight must be [{dim}], got {tuple(weight.shape)}")
    from deepinfer_backends.sm100.kernels.rms_norm import tl_dtype

    threads = next((t for t in (256, 128, 64) if dim % t == 0 and dim // t >= 4), 32)
    flat = x.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    residual_dtype = None if residual is None else tl_dtype(residual.dtype)
    kernel = compiled("rms_norm", "rms_norm", dim, float(eps), tl_dtype(x.dtype), residual_dtype, threads=threads)
    if residual is None:
        if flat.shape[0]:
            kernel(flat, weight.float().contiguous(), out)
        return out.reshape(x.shape)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    residual_flat = residual.reshape(-1, dim).contiguous()
    residual_out = torch.empty_like(residual_flat)
    if flat.shape[0]:
        kernel(flat, residual_flat, weight.float().contiguous(), out, residual_out)
    return out.reshape(x.shape), residual_out.reshape(x.shape)


def kv_norm_rope_store(x, weight, eps, positions, cos_sin, cache, slots, fmt):
    """HAL ``kv_norm_rope_store``: one CTA per token normalises, rotates, encodes and stores the
    row and writes its decoded copy; bf16 ``x [T, 512]``, ``fp8`` (528 B) or ``bf16`` cache rows.
    Positions and slots are not range-checked on the device (that would cost a host sync): a slot
    past the cache is not stored, and a position past the table rotates by zeros."""
    op = "kv_norm_rope_store"
    _require(fmt in ("fp8", "bf16"), op, f"cache format {fmt!r} is not implemented (fp8 and bf16 are)")
    _cuda_bf16(op, "x", x)
    dim = token_format(fmt).dim
    if x.dim() != 2 or x.shape[1] != dim or weight.shape != (dim,):
        raise ValueError(f"{op}: expects x [T, {dim}] and weight [{dim}] for format {fmt!r}; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    for name, index in (("positions", positions), ("slots", slots)):
        if index.dtype != torch.int64 or index.shape != (x.shape[0],):
            raise ValueError(f"{op}: {name} must be int64 [T={x.shape[0]}], got {index.dtype} {tuple(index.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or not cos_sin.is_floating_point():
        raise ValueError(f"{op}: cos_sin must be a float [P, rope_dim] table with even rope_dim, got "
                         f"{cos_sin.dtype} {tuple(cos_sin.shape)}")
    rope_dim = cos_sin.shape[1]
    _require(rope_dim % 8 == 0 and rope_dim <= dim, op, f"rope_dim={rope_dim} must be a multiple of 8 up to {dim}")
    _require(all(t.is_cuda for t in (weight, positions, cos_sin, cache, slots)), op,
             "weight, positions, cos_sin, cache and slots must be CUDA tensors")
    rows = cache_rows(cache, token_format(fmt))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        kernel = compiled("kv_norm_rope_store", "kv_norm_rope_store", dim, rope_dim, float(eps), fmt)
        kernel(x.contiguous(), weight.float().contiguous(), positions.contiguous(), cos_sin.float().contiguous(),
               slots.contiguous(), rows.view(torch.bfloat16) if fmt == "bf16" else rows, y)
    return y


def indexer_logits(q, k, weights, q_format="mxfp4"):
    """HAL ``indexer_logits``: q cast through MXFP4 here (exact in bf16), then one tensor-core
    GEMM per token and key tile; heads padded to 64 and dim to 32 with zeros (no effect).

    The GEMM reads bf16: float32 keys are rounded to bf16, which is exact for the model's keys
    (decoded from the FP4 index cache: e2m1 times a power of two), as are MXFP4-cast queries."""
    op = "indexer_logits"
    _require(q.is_cuda and k.is_cuda, op, f"q and k must be CUDA tensors, got {q.device} and {k.device}")
    floats = (torch.bfloat16, torch.float32)
    _require(q.dtype in floats and k.dtype in floats, op, f"q and k must be bfloat16 or float32, got {q.dtype} "
                                                          f"and {k.dtype}")
    from deepinfer.hal.ops.indexer import Q_FORMATS
    from deepinfer.hal.formats import cast_back

    if q_format not in Q_FORMATS or q.ndim != 3 or k.ndim != 2 or k.shape[1] != q.shape[2] \
            or weights.shape != q.shape[:2] or (q_format == "mxfp4" and q.shape[2] % 32):
        from deepinfer.hal.ops.indexer import indexer_logits as reference

        return reference(q, k, weights, q_format)  # raises the HAL's own message
    tokens, heads, dim = q.shape
    queries = cast_back(q, "mxfp4", 32).to(torch.bfloat16) if q_format == "mxfp4" else q
    heads_pad, dim_pad = -(-heads // 64) * 64, -(-dim // 32) * 32
    q_in = torch.zeros(tokens, heads_pad, dim_pad, dtype=torch.bfloat16, device=q.device)
    q_in[:, :heads, :dim] = queries
    k_in = torch.zeros(k.shape[0], dim_pad, dtype=torch.bfloat16, device=k.device)
    k_in[:, :dim] = k
    w_in = torch.zeros(tokens, heads_pad, dtype=torch.float32, device=q.device)
    w_in[:, :heads] = weights.float()
    logits = torch.empty(tokens, k.shape[0], dtype=torch.float32, device=q.device)
    if tokens and k.shape[0]:
        compiled("indexer_logits", "indexer_logits", heads_pad, dim_pad)(q_in, k_in, w_in, logits)
    return logits

"""sm100 attention wrappers (HAL ``mla_sparse_decode``, ``mla_sparse_prefill``, ``indexer_logits``):
layouts checked, heads padded to the kernel's head block, split-KV chosen (or off), lists aligned
to key blocks."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import cache_rows
from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.launch import compiled, cuda_bf16, require
from deepinfer_backends.sm100.options import DEFAULT, KernelOptions

HEAD_BLOCK = 64
KEY_BLOCK = {"sparse_mla": 64, "sparse_mla_ws": 32}
"""Keys per block of each sparse MLA kernel by default: a row's online softmax steps through its
lists in blocks of this many keys, whatever the batch."""
WS_PREFILL = {"block_k": 64, "key_stages": 2}
"""The warp-specialised kernel's key ring for prefill outside the batch-invariant mode: 64-key
blocks, two of them (bf16 keys leave no raw ring beside them, so they fit; decode's quantized rows
do not). Faster than 32-key blocks on the prefill shapes: the score wgmmas read the queries from
shared memory once per 64 keys instead of once per 32 (``experiments/results/sm100_design_measurements_h200.md``)."""


def mla_kernel(op: str, arch: str | None = None, batch_invariant: bool = False,
               options: KernelOptions = DEFAULT) -> tuple[str, str, dict]:
    """``(kernels module, factory, options)`` of the sparse MLA kernel serving ``op`` on ``arch``
    (default: this GPU's), as ``options.mla_kernel`` picks it. The warp-specialised kernel
    (``kernels/mla_sparse_ws.py``, Hopper; ``auto`` there): 32-key blocks for decode, and for
    prefill in the batch-invariant mode (so a token gets the same bits through both),
    :data:`WS_PREFILL` for prefill otherwise. With ``options.tcgen05``, decode runs its tcgen05
    variant (Blackwell only); otherwise the portable kernel."""
    if options.tcgen05:
        return toolchain.kernel_module(op, "mla_sparse_decode", tcgen05=True), "sparse_mla", {}
    if options.mla_kernel == "portable":
        return "mla_sparse_decode", "sparse_mla", {}
    arch = arch or toolchain.device_arch()
    if arch != toolchain.HOPPER:
        if options.mla_kernel == "warp_specialized":
            raise RuntimeError(f"backend.options.mla_kernel=warp_specialized needs Hopper ({toolchain.HOPPER}); this "
                               f"device is {arch}. Use mla_kernel=auto or portable")
        return "mla_sparse_decode", "sparse_mla", {}
    if op == "mla_sparse_prefill" and not batch_invariant:
        return "mla_sparse_ws", "sparse_mla_ws", dict(WS_PREFILL)
    return "mla_sparse_ws", "sparse_mla_ws", {"block_k": KEY_BLOCK["sparse_mla_ws"]}


def key_block(kernel: tuple[str, str, dict]) -> int:
    """Keys per block of ``kernel`` as :func:`mla_kernel` returns it."""
    return kernel[2].get("block_k", KEY_BLOCK[kernel[1]])


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
               split_kv: bool, kernel: tuple[str, str, dict]):
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
    module, factory, options = kernel
    out = torch.empty(rows, padded, dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(rows, padded, dtype=torch.float32, device=q.device)
    if rows:
        kernel = compiled(module, factory, *config, splits=splits, **options)
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
    """KV splits for ``ctas`` CTAs: the count (up to 16) that minimises waves x work per CTA, where
    each split takes an equal, block-padded slice of both key lists and every CTA also pays about
    one key block of fixed cost (loading its queries and key lists)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def cost(splits: int) -> int:  # waves x (key blocks of a split + about one block of fixed cost per CTA)
        return -(-ctas * splits // sms) * (-(-main_blocks // splits) - (-extra_blocks // splits) + 1)

    return min(range(1, 17), key=lambda splits: (cost(splits), splits))


def mla_sparse_decode(q, cache, indices, sink, scale, cache_format="fp8", extra_cache=None, extra_indices=None,
                      extra_format="fp4", split_kv: bool = True, options: KernelOptions = DEFAULT):
    """HAL ``mla_sparse_decode`` on the tensor cores: bf16 ``q [B, s_q, h, 512]``, main cache ``fp8``
    (528 B) or ``bf16`` rows, optional ``fp4`` (288 B) extra cache beside an fp8 main cache. ``split_kv=False`` keeps one
    CTA per row (the batch-invariant order). Index values past the cache are treated as padding.
    ``options`` (``backend.options``) picks the kernel (:func:`mla_kernel`)."""
    op = "mla_sparse_decode"
    require(cache_format in ("fp8", "bf16"), op, f"main cache format {cache_format!r} is not implemented "
             f"(fp8 and bf16 are)")
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError(f"{op}: extra_cache and extra_indices go together")
    require(extra_cache is None or (extra_format == "fp4" and cache_format == "fp8"), op,
             f"an extra cache in {extra_format!r} beside a {cache_format!r} main cache is not implemented "
             f"(fp4 beside fp8 is)")
    cuda_bf16(op, "q", q)
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
    kernel = mla_kernel(op, toolchain.device_arch(q.device.index or 0), options=options)
    out, lse = _attention(op, q.reshape(batch * s_q, heads, dim), main, indices.reshape(batch * s_q, -1), extra,
                          extra_indices, sink, scale, cache_format, split_kv, kernel)
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def mla_sparse_prefill(q, kv, indices, sink, scale, main_keys: int | None = None, split_kv: bool = True,
                       batch_invariant: bool = False, options: KernelOptions = DEFAULT):
    """HAL ``mla_sparse_prefill`` on the tensor cores: bf16 ``q [T, h, D]``, ``kv [S, D]``
    (D a multiple of 64, up to 512). With ``main_keys``, the main list is padded with ``-1`` to
    whole key blocks of the serving kernel. With ``batch_invariant`` (which the batch-invariant
    table sets, beside ``split_kv=False``) those are decode's key blocks, so both paths walk the
    same blocks and give a token the same bits."""
    op = "mla_sparse_prefill"
    cuda_bf16(op, "q", q)
    cuda_bf16(op, "kv", kv)
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: expects q [T, h, D] and kv [S, D]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}")
    require(q.shape[2] % 64 == 0 and q.shape[2] <= 512, op, f"D={q.shape[2]} must be a multiple of 64 up to 512")
    _check_indices(op, "indices", indices, (q.shape[0],))
    _check_sink(op, sink, q.shape[1])
    if main_keys is not None and not (isinstance(main_keys, int) and 0 <= main_keys <= indices.shape[1]):
        raise ValueError(f"{op}: main_keys must be an int in [0, K={indices.shape[1]}], got {main_keys!r}")
    kernel = mla_kernel(op, toolchain.device_arch(q.device.index or 0), batch_invariant, options)
    return _attention(op, q, kv.contiguous(), align_lists(indices, main_keys, key_block(kernel)), None, None, sink,
                      scale, "bf16", split_kv, kernel)


def align_lists(indices: torch.Tensor, main_keys: int | None, block: int | None = None) -> torch.Tensor:
    """``indices [T, K]`` with its first ``main_keys`` columns padded by ``-1`` to a multiple of
    ``block`` (default: the decode kernel's key block) when another list follows them."""
    block = block or key_block(mla_kernel("mla_sparse_decode"))
    pad = -(main_keys or 0) % block
    if main_keys is None or not pad or main_keys == indices.shape[1]:
        return indices
    filler = indices.new_full((indices.shape[0], pad), -1)
    return torch.cat((indices[:, :main_keys], filler, indices[:, main_keys:]), dim=1)


def _check_sink(op: str, sink: torch.Tensor, heads: int) -> None:
    if sink.shape != (heads,):
        raise ValueError(f"{op}: sink must be float32 [h={heads}], got {tuple(sink.shape)}")


def indexer_logits(q, k, weights, q_format="mxfp4", weight_scale: float = 1.0):
    """HAL ``indexer_logits``: q cast through MXFP4 here (exact in bf16; one Triton kernel,
    :mod:`.fused.mxfp4_cast`, for a power-of-two head dim; with ``q_format=None`` bf16 q is read
    as it is, as the model's queries come cast by ``stacked_linear``), then one tensor-core
    GEMM per token and key tile; heads padded to 64 and dim to 32 with zeros (no effect). Keys
    ``[S, d]`` are shared by every query, keys ``[B, S, d]`` are one list per sequence. The
    weights (float32 or bf16) are read and scaled by ``weight_scale`` in the kernel.

    The GEMM reads bf16: float32 keys are rounded to bf16, which is exact for the model's keys
    (decoded from the FP4 index cache: e2m1 times a power of two), as are MXFP4-cast queries."""
    op = "indexer_logits"
    require(q.is_cuda and k.is_cuda, op, f"q and k must be CUDA tensors, got {q.device} and {k.device}")
    floats = (torch.bfloat16, torch.float32)
    require(q.dtype in floats and k.dtype in floats, op, f"q and k must be bfloat16 or float32, got {q.dtype} "
                                                          f"and {k.dtype}")
    from deepinfer.hal.formats import cast_back
    from deepinfer.hal.ops.indexer import check_indexer_logits

    check_indexer_logits(q, k, weights, q_format)
    tokens, heads, dim = q.shape
    keys = k.shape[-2]
    heads_pad, dim_pad = -(-heads // 64) * 64, -(-dim // 32) * 32
    padded = heads_pad != heads or dim_pad != dim
    if q_format is None and not padded and q.dtype == torch.bfloat16:
        q_in = q.contiguous()  # read as it is
    else:
        q_in = (torch.zeros if padded else torch.empty)(tokens, heads_pad, dim_pad, dtype=torch.bfloat16,
                                                        device=q.device)
        if q_format == "mxfp4" and dim % 32 == 0 and dim & (dim - 1) == 0:
            from deepinfer_backends.sm100.fused.mxfp4_cast import BLOCK_ROWS, mxfp4_cast_kernel

            if tokens:
                mxfp4_cast_kernel[(-(-tokens * heads // BLOCK_ROWS),)](
                    q.contiguous(), q_in, tokens * heads, heads, heads_pad, dim_pad, DIM=dim, BLOCK_ROWS=BLOCK_ROWS)
        else:
            q_in[:, :heads, :dim] = cast_back(q, "mxfp4", 32) if q_format == "mxfp4" else q
    if dim_pad == dim:
        k_in = k.to(torch.bfloat16).contiguous()
    else:
        k_in = torch.zeros(*k.shape[:-1], dim_pad, dtype=torch.bfloat16, device=k.device)
        k_in[..., :dim] = k
    if heads_pad == heads:
        w_in = weights.contiguous()
    else:
        w_in = torch.zeros(tokens, heads_pad, dtype=weights.dtype, device=q.device)
        w_in[:, :heads] = weights
    logits = torch.empty(tokens, keys, dtype=torch.float32, device=q.device)
    if tokens and keys:
        per_seq = tokens // k.shape[0] if k.dim() == 3 else 0
        extra = {} if weights.dtype == torch.float32 else {"weights_dtype": "bfloat16"}
        if weight_scale != 1.0:
            extra["weight_scale"] = float(torch.tensor(weight_scale, dtype=torch.float32))
        compiled("indexer_logits", "indexer_logits", heads_pad, dim_pad, queries_per_seq=per_seq, **extra)(
            q_in, k_in, w_in, logits)
    return logits

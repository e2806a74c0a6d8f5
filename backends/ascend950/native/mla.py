"""Native ascend950 sparse MLA: decode over a ``bf16`` or ``fp8`` cache, with or without an extra
``fp8`` or ``fp4`` cache list, through
:mod:`~deepinfer_backends.ascend950.kernels.mla_sparse_decode`, prefill over a bf16 latent
buffer through :mod:`~deepinfer_backends.ascend950.kernels.mla_sparse_prefill`, both with the
emulation's plan (:func:`~deepinfer_backends.ascend950.emulate.mla.buffers`, padding indices
masked). Heads are padded with zero queries to whole groups of ``HEAD_GROUP``, a head dim that
is not a whole number of ``D_SPLIT`` steps with zero columns (of the queries and keys, exact),
and each index list with ``-1`` to whole key tiles
(:func:`~deepinfer_backends.ascend950.emulate.mla.padded_lists`), so the kernels walk the
emulation's tiles; the padded heads and columns are dropped from the results."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import token_format
from deepinfer.hal.ops.kv_cache import cache_rows
from deepinfer.hal.ops.mla import check_prefill_args
from deepinfer_backends.ascend950.buffers import AI_CORES
from deepinfer_backends.ascend950.emulate import mla as plan
from deepinfer_backends.ascend950.native.launch import Kernels, check_device, plan_offsets, refuse, round_up, whole

DECODE, PREFILL = "mla_sparse_decode", "mla_sparse_prefill"
CACHE_FORMATS = ("bf16", "fp8")
"""Cache formats the decode kernel reads for the main list."""
EXTRA_FORMATS = ("fp8", "fp4")
"""Cache formats the decode kernel reads for the extra list."""


def mla_sparse_decode(kernels: Kernels, q, cache, indices, sink, scale, cache_format="fp8", extra_cache=None,
                      extra_indices=None, extra_format="fp4"):
    """:func:`deepinfer.hal.ops.mla.mla_sparse_decode` on the NPU: bf16 queries over one ``bf16``
    or ``fp8`` cache, and an extra ``fp8`` or ``fp4`` cache list when given."""
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError("extra_cache and extra_indices go together; got only "
                         f"{'extra_cache' if extra_indices is None else 'extra_indices'}")
    if cache_format not in CACHE_FORMATS:
        raise refuse(DECODE, f"the kernel reads {list(CACHE_FORMATS)} caches for the main list, not {cache_format!r}")
    if extra_cache is not None and extra_format not in EXTRA_FORMATS:
        raise refuse(DECODE, f"the kernel reads {list(EXTRA_FORMATS)} caches for the extra list, not "
                             f"{extra_format!r}")
    if q.dim() != 4 or q.dtype != torch.bfloat16:
        raise refuse(DECODE, f"the kernel takes bf16 queries [B, s_q, h, D], got {q.dtype} {tuple(q.shape)}")
    spec = token_format(cache_format)
    batch, s_q, heads, dim = q.shape
    if dim != spec.dim:
        raise ValueError(f"cache format {cache_format!r} holds {spec.dim}-dim tokens but q has D={dim}")
    rows = cache_rows(cache, spec)
    lists = [_index_list(indices, "indices", batch, s_q)]
    extra = None
    if extra_cache is not None:
        extra_spec = token_format(extra_format)
        if extra_spec.dim != dim:
            raise ValueError(f"extra format {extra_format!r} holds {extra_spec.dim}-dim tokens but q has D={dim}")
        extra = (cache_rows(extra_cache, extra_spec), extra_format)
        lists.append(_index_list(extra_indices, "extra_indices", batch, s_q))
    kv = rows.view(torch.bfloat16) if cache_format == "bf16" else rows
    out, lse = _attend(kernels, DECODE, q.reshape(batch * s_q, heads, dim), kv, torch.cat(lists, dim=1), sink,
                       scale, indices.shape[-1], cache_format, extra)
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def _index_list(indices: torch.Tensor, name: str, batch: int, s_q: int) -> torch.Tensor:
    """``indices int32 [B, s_q, K]`` as ``[B * s_q, K]``."""
    if indices.dtype != torch.int32 or indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, s_q):
        raise ValueError(f"{name} must be int32 [{batch}, {s_q}, K], got {indices.dtype} {tuple(indices.shape)}")
    return indices.reshape(batch * s_q, -1)


def mla_sparse_prefill(kernels: Kernels, q, kv, indices, sink, scale, main_keys=None):
    """:func:`deepinfer.hal.ops.mla.mla_sparse_prefill` on the NPU for bf16 queries and keys."""
    check_prefill_args(q, kv, indices, sink, main_keys)
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise refuse(PREFILL, f"the kernel takes bf16 queries and keys, got q {q.dtype} and kv {kv.dtype}")
    return _attend(kernels, PREFILL, q, kv, indices, sink, scale,
                   indices.shape[-1] if main_keys is None else main_keys, "bf16")


def _attend(kernels: Kernels, op: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
            scale: float, main: int, cache_format: str,
            extra: tuple[torch.Tensor, str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, h, D] bf16, lse float32 [T, h])`` of ``q [T, h, D]`` over the rows of ``kv`` at
    ``indices [T, K]`` (the first ``main`` columns one list, the rest another: with ``extra``,
    ``(rows, format)`` of a second cache, that list's rows)."""
    if sink.shape != (q.shape[1],):
        raise ValueError(f"sink must be float32 [h={q.shape[1]}], got {tuple(sink.shape)}")
    check_device(op, q=q, kv=kv, indices=indices, sink=sink, extra=None if extra is None else extra[0])
    tokens, heads, dim = q.shape
    if tokens == 0 or indices.shape[1] == 0:
        return (torch.zeros_like(q),
                torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device))
    quantized = cache_format != "bf16"
    whole_heads = round_up(heads, plan.HEAD_GROUP)
    whole_dim = dim if quantized else round_up(dim, plan.D_SPLIT)
    padded_main, topk = plan.padded_lists(main, indices.shape[1])
    lists = torch.full((tokens, topk), -1, dtype=torch.int32, device=indices.device)
    lists[:, :main] = indices[:, :main]
    lists[:, padded_main:padded_main + indices.shape[1] - main] = indices[:, main:]
    formats = tuple(dict.fromkeys(f for f in (cache_format, extra and extra[1]) if f in plan.CACHE_ROW_BYTES))
    buffers = plan.buffers(whole_dim, 2, formats, masked=True)
    arguments = dict(tokens=tokens, heads=whole_heads, dim=whole_dim, topk=topk, kv_rows=kv.shape[0],
                     head_group=plan.HEAD_GROUP, key_tile=plan.KEY_TILE, d_split=plan.D_SPLIT,
                     cores=AI_CORES[kernels.platform], scale=float(scale),
                     offsets=plan_offsets(op, buffers, kernels.platform), dtype="bfloat16")
    if op == PREFILL:
        arguments["main_keys"] = padded_main
    else:
        arguments.update(cache_format=cache_format, masked=True)
    if extra is not None:
        arguments.update(extra_format=extra[1], extra_rows=extra[0].shape[0], main_keys=padded_main)
    caches = 1 if extra is None else 2
    kernel = kernels.get(op, arguments, out_idx=[7 + caches, 8 + caches],
                         workspace_idx=[3 + caches, 4 + caches, 5 + caches, 6 + caches])
    keys = kv if quantized else whole(kv, (kv.shape[0], whole_dim))
    out, lse = kernel(whole(q, (tokens, whole_heads, whole_dim)), keys, *([] if extra is None else [extra[0]]),
                      lists, whole(sink.float(), (whole_heads,)))
    return out[:, :heads, :dim], lse[:, :heads]

"""Sparse MLA attention: MQA over a shared latent where V is K, with per-query index lists.

Every query row attends to its own list of key rows (``-1`` entries are padding, duplicates are
separate keys). Logits are ``scale * q . k`` in float32; the per-head attention sink acts as one
extra key of logit ``sink[h]`` and zero value, i.e. the softmax output is multiplied by
``sigmoid(lse - sink[h])``. A row with no valid key gives ``out = 0`` and ``lse = -inf``."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import TOKEN_FORMATS, decode_tokens, encode_tokens, token_format
from deepinfer.hal.ops.kv_cache import cache_rows
from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

GATHER_BUDGET = 1 << 27  # float32 key values gathered at once by prefill (512 MiB)


def mla_sparse_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                       scale: float, main_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over a key buffer: returns ``(out [T, h, D] in q.dtype, lse float32 [T, h])``.

    ``q [T, h, D]``, ``kv [S, D]`` (keys, also the values), ``indices int32 [T, K]`` rows of
    ``kv`` per query (``-1`` padding), ``sink float32 [h]``. ``main_keys`` (optional, in
    ``[0, K]``) says the first ``main_keys`` columns are one list and the rest another, as
    :func:`mla_sparse_decode`'s main and extra lists; the result does not depend on it, but a
    backend working in key blocks aligns each list to its blocks, so a token gets the bits the
    decode path gives it. Queries are processed in chunks so the gathered keys stay within
    ``GATHER_BUDGET`` values."""
    check_prefill_args(q, kv, indices, sink, main_keys)
    rows_per_chunk = max(1, GATHER_BUDGET // max(1, indices.shape[1] * kv.shape[1]))
    outs, lses = [], []
    for start in range(0, max(1, q.shape[0]), rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        out, lse = sparse_attention(q[chunk], *gather_keys(kv, indices[chunk]), sink, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check_prefill_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                       main_keys: int | None = None) -> None:
    """Raise a clear error unless the arguments fit :func:`mla_sparse_prefill`'s contract."""
    _check_query(q, 3)
    if kv.dim() != 2 or kv.shape[1] != q.shape[-1]:
        raise ValueError(f"kv must be [S, D={q.shape[-1]}], got {tuple(kv.shape)}")
    _check_indices(indices, "indices", q.shape[:-2], kv.shape[0])
    _check_sink(sink, q.shape[-2])
    if main_keys is not None and not (isinstance(main_keys, int) and 0 <= main_keys <= indices.shape[-1]):
        raise ValueError(f"main_keys must be an int in [0, K={indices.shape[-1]}] (the main list's columns), "
                         f"got {main_keys!r}")


def gather_keys(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys ``[T, K, D]`` at ``indices [T, K]`` of ``kv [S, D]``, and their validity."""
    return kv[indices.clamp(min=0).long()].float(), indices >= 0


def mla_sparse_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                      scale: float, cache_format: str = "fp8", extra_cache: torch.Tensor | None = None,
                      extra_indices: torch.Tensor | None = None,
                      extra_format: str = "fp4") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over quantized caches: ``(out [B, s_q, h, D] in q.dtype, lse float32 [B, s_q, h])``.

    ``q [B, s_q, h, D]`` with ``D`` the formats' 512; ``indices int32 [B, s_q, K]`` are flat
    rows of ``cache`` (``uint8 [..., bytes]`` in ``cache_format``, viewed as ``[rows, bytes]``),
    ``-1`` padding. The optional ``extra_cache`` (``extra_format``, e.g. the FP4 compressed
    cache) with ``extra_indices [B, s_q, K2]`` adds keys; the softmax runs over the union."""
    keys, valid = decode_keys(q, cache, indices, sink, cache_format, extra_cache, extra_indices, extra_format)
    batch, s_q, heads, dim = q.shape
    out, lse = sparse_attention(q.reshape(batch * s_q, heads, dim), keys, valid, sink, scale)
    return out.reshape(q.shape), lse.reshape(batch, s_q, heads)


def decode_keys(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                cache_format: str = "fp8", extra_cache: torch.Tensor | None = None,
                extra_indices: torch.Tensor | None = None, extra_format: str = "fp4"):
    """Check :func:`mla_sparse_decode`'s arguments; returns each query's decoded float32 keys
    ``[B * s_q, K (+ K2), D]`` (main, then extra) and their validity."""
    _check_query(q, 4)
    if (extra_cache is None) != (extra_indices is None):
        raise ValueError("extra_cache and extra_indices go together; got only "
                         f"{'extra_cache' if extra_indices is None else 'extra_indices'}")
    keys, valid = _decoded_keys(cache, indices, cache_format, q, "indices")
    if extra_cache is not None:
        extra_keys, extra_valid = _decoded_keys(extra_cache, extra_indices, extra_format, q, "extra_indices")
        keys, valid = torch.cat((keys, extra_keys), dim=1), torch.cat((valid, extra_valid), dim=1)
    _check_sink(sink, q.shape[2])
    return keys, valid


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Core math on gathered keys: ``q [N, h, D]``, ``keys float32 [N, K, D]`` (also the values),
    ``valid bool [N, K]``; returns ``(out [N, h, D] in q.dtype, lse float32 [N, h])``."""
    logits = scale * torch.einsum("nhd,nkd->nhk", q.float(), keys)
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1)).masked_fill(~valid.unsqueeze(1), 0.0)
    out = torch.einsum("nhk,nkd->nhd", probs, keys) * torch.sigmoid(lse - sink.float()).unsqueeze(-1)
    return out.to(q.dtype), lse


def _decoded_keys(cache: torch.Tensor, indices: torch.Tensor, fmt: str, q: torch.Tensor, name: str):
    """Decoded float32 keys ``[B * s_q, K, D]`` at ``indices`` of ``cache``, and their validity."""
    spec = token_format(fmt)
    if spec.dim != q.shape[-1]:
        raise ValueError(f"cache format {fmt!r} holds {spec.dim}-dim tokens but q has D={q.shape[-1]}")
    rows = cache_rows(cache, spec)
    _check_indices(indices, name, q.shape[:2], rows.shape[0])
    flat = indices.reshape(-1, indices.shape[-1])
    return decode_tokens(rows[flat.clamp(min=0).long()], fmt), flat >= 0


def _check_query(q: torch.Tensor, dims: int) -> None:
    if q.dim() != dims or not q.is_floating_point():
        layout = "[T, h, D]" if dims == 3 else "[B, s_q, h, D]"
        raise ValueError(f"q must be a float tensor {layout}, got {q.dtype} {tuple(q.shape)}")


def _check_indices(indices: torch.Tensor, name: str, leading: torch.Size, num_rows: int) -> None:
    if indices.dtype != torch.int32 or indices.dim() != len(leading) + 1 \
            or tuple(indices.shape[:-1]) != tuple(leading):
        raise ValueError(f"{name} must be int32 [{', '.join(map(str, leading))}, K], "
                         f"got {indices.dtype} {tuple(indices.shape)}")
    if value_checks() and indices.numel() and (indices.min() < -1 or indices.max() >= num_rows):
        raise ValueError(f"{name} must lie in [0, {num_rows}) or be -1 (padding); got values in "
                         f"[{indices.min().item()}, {indices.max().item()}]")


def _check_sink(sink: torch.Tensor, heads: int) -> None:
    if sink.shape != (heads,):
        raise ValueError(f"sink must be float32 [h={heads}], got {tuple(sink.shape)}")


def _indices(gen: torch.Generator, rows: int, k: int, num_keys: int, padded: int, duplicates: bool):
    """``int32 [rows, k]`` random key rows, distinct unless ``duplicates`` (then drawn from only 4
    keys); the last ``padded`` of each row are -1."""
    indices = torch.randint(0, min(4, num_keys), (rows, k), generator=gen) if duplicates else \
        torch.stack([torch.randperm(num_keys, generator=gen)[:k] for _ in range(rows)])
    if padded:
        indices[:, k - padded:] = -1
    return indices.int()


def _prefill_case(t: int, h: int, d: int, s: int, k: int, padded: int = 0, duplicates: bool = False,
                  empty_rows: tuple[int, ...] = (), dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        indices = _indices(gen, t, k, s, padded, duplicates)
        indices[list(empty_rows)] = -1
        return {
            "q": torch.randn(t, h, d, generator=gen).to(device, dtype),
            "kv": torch.randn(s, d, generator=gen).to(device, dtype),
            "indices": indices.to(device),
            "sink": torch.randn(h, generator=gen).to(device),
            "scale": d ** -0.5,
        }
    return make


def _cache(gen: torch.Generator, fmt: str, blocks: int, block_size: int) -> torch.Tensor:
    spec = TOKEN_FORMATS[fmt]
    return encode_tokens(torch.randn(blocks * block_size, spec.dim, generator=gen), fmt).reshape(
        blocks, block_size, spec.bytes_per_token)


def _decode_case(b: int, s_q: int, h: int, k: int, cache_format: str, extra_k: int = 0, padded: int = 0,
                 duplicates: bool = False, empty_rows: bool = False, dtype=torch.float32):
    def make(gen: torch.Generator, device: torch.device):
        q = torch.randn(b, s_q, h, 512, generator=gen).to(device, dtype)
        indices = _indices(gen, b * s_q, k, 4 * 64, padded, duplicates).reshape(b, s_q, k)
        args = {"q": q, "cache": _cache(gen, cache_format, 4, 64).to(device), "cache_format": cache_format,
                "sink": torch.randn(h, generator=gen).to(device), "scale": 512 ** -0.5}
        if extra_k:
            extra = _indices(gen, b * s_q, extra_k, 8 * 128, padded, duplicates).reshape(b, s_q, extra_k)
            args.update(extra_cache=_cache(gen, "fp4", 8, 128).to(device), extra_format="fp4")
            if empty_rows:
                extra[0, -1] = -1
            args["extra_indices"] = extra.to(device)
        if empty_rows:
            indices[0, -1] = -1
        args["indices"] = indices.to(device)
        return args
    return make


register(OpSpec(
    name="mla_sparse_prefill",
    summary="sparse MQA (V = K) over a key buffer through per-query index lists, with attention sink",
    reference=mla_sparse_prefill,
    cases=(
        OpCase("tiny", _prefill_case(t=5, h=2, d=64, s=40, k=8, padded=3)),
        OpCase("tiny_duplicates", _prefill_case(t=4, h=2, d=64, s=6, k=10, duplicates=True)),
        OpCase("tiny_empty_rows", _prefill_case(t=6, h=2, d=64, s=30, k=6, padded=2, empty_rows=(1, 4))),
        OpCase("tiny_bf16", _prefill_case(t=5, h=2, d=64, s=40, k=8, padded=3, dtype=torch.bfloat16),
               dtype=torch.bfloat16),
        OpCase("tiny_bf16_empty_rows", _prefill_case(t=6, h=2, d=64, s=30, k=6, padded=2, empty_rows=(1, 4),
                                                     dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41", _prefill_case(t=8, h=64, d=512, s=1024, k=128 + 512, padded=40), size="real"),
        OpCase("v41_bf16", _prefill_case(t=8, h=64, d=512, s=1024, k=128 + 512, padded=40, dtype=torch.bfloat16),
               size="real", dtype=torch.bfloat16),
    ),
))

register(OpSpec(
    name="mla_sparse_decode",
    summary="sparse MQA (V = K) over quantized paged caches (main + extra) through index lists, with sink",
    reference=mla_sparse_decode,
    cases=(
        OpCase("tiny_bf16_cache", _decode_case(b=2, s_q=1, h=2, k=6, cache_format="bf16", padded=2)),
        OpCase("tiny_fp8_fp4", _decode_case(b=1, s_q=2, h=2, k=4, cache_format="fp8", extra_k=5, padded=1)),
        OpCase("tiny_duplicates", _decode_case(b=1, s_q=2, h=2, k=12, cache_format="fp8", extra_k=6,
                                               duplicates=True)),
        OpCase("tiny_empty_rows", _decode_case(b=2, s_q=2, h=2, k=4, cache_format="fp8", extra_k=3, padded=1,
                                               empty_rows=True)),
        OpCase("tiny_bf16_fp8_fp4", _decode_case(b=2, s_q=2, h=2, k=4, cache_format="fp8", extra_k=5, padded=1,
                                                 empty_rows=True, dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("tiny_bf16_bf16_cache", _decode_case(b=2, s_q=1, h=2, k=6, cache_format="bf16", padded=2,
                                                    dtype=torch.bfloat16), dtype=torch.bfloat16),
        OpCase("v41", _decode_case(b=2, s_q=2, h=64, k=128, cache_format="fp8", extra_k=512, padded=17),
               size="real"),
        OpCase("v41_bf16", _decode_case(b=2, s_q=2, h=64, k=128, cache_format="fp8", extra_k=512, padded=17,
                                        dtype=torch.bfloat16), size="real", dtype=torch.bfloat16),
        OpCase("v41_bf16_h128", _decode_case(b=1, s_q=2, h=128, k=128, cache_format="fp8", extra_k=512, padded=17,
                                             dtype=torch.bfloat16), size="real", dtype=torch.bfloat16),
    ),
))

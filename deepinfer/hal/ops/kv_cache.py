"""KV cache store and load: token rows encoded in a cache format, addressed by flat slot.

A cache is a contiguous ``uint8`` tensor whose last dim is the format's bytes per token; any
leading shape (``[blocks, block_size, bytes]`` for paged caches, ``[slots, bytes]`` for state
rings) is viewed as ``[num_slots, bytes]`` and a slot is a row of that view. Slot ``-1`` is
padding. Formats are those of :mod:`deepinfer.hal.formats` (``bf16``, ``fp8`` 528 B, ``fp4``
288 B, ``index_fp4`` 68 B, ``index_bf16``)."""
from __future__ import annotations

import torch

from deepinfer.hal.formats import TOKEN_FORMATS, TokenFormat, decode_tokens, encode_tokens, token_format
from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks


def kv_store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Encode ``x [n, dim]`` in format ``fmt`` and write row ``i`` at flat slot ``slots[i]``.

    ``cache`` is ``uint8 [..., bytes_per_token]`` and is written in place (and returned);
    ``slots`` is ``int64 [n]``, ``-1`` skips the row. Valid slots must be distinct."""
    spec = token_format(fmt)
    rows = cache_rows(cache, spec)
    check_slots(slots, rows.shape[0])
    if x.dim() != 2 or x.shape != (slots.shape[0], spec.dim) or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [n={slots.shape[0]}, dim={spec.dim}] for format "
                         f"{fmt!r}, got {x.dtype} {tuple(x.shape)}")
    if slots.numel():
        store_rows(rows, slots, encode_tokens(x.contiguous(), fmt))
    return cache


def store_rows(dest: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``dest[index[i]] = values[i]`` for every ``i`` with ``index[i] >= 0`` (kept indices distinct),
    without a host sync: a skipped row writes the first kept row's value to that row's
    destination (or, when no row is kept, row 0's own value back to row 0), so every destination
    written receives exactly one value."""
    if not index.numel():
        return
    keep = index >= 0
    first = keep.int().argmax().view(1)
    any_kept = keep.any()
    target = torch.where(keep, index, torch.where(any_kept, index.index_select(0, first), 0))
    fill = torch.where(any_kept, values.index_select(0, first), dest[:1])
    dest.index_copy_(0, target, torch.where(keep.view(-1, *[1] * (values.dim() - 1)), values, fill))


LOAD_DTYPES = (torch.float32, torch.bfloat16)
"""What ``kv_load`` decodes to: every format's values are exact in both."""


def kv_load(cache: torch.Tensor, slots: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode the rows at flat ``slots [n]`` (int64 or int32) of ``cache`` (format ``fmt``) into
    ``dtype`` (float32 or bfloat16; exact in both) ``[n, dim]``.

    Slot ``-1`` gives a row of zeros."""
    spec = token_format(fmt)
    rows = cache_rows(cache, spec)
    check_slots(slots, rows.shape[0], (torch.int64, torch.int32))
    if dtype not in LOAD_DTYPES:
        raise ValueError(f"kv_load decodes to one of {LOAD_DTYPES}, got dtype={dtype}")
    keep = slots >= 0
    decoded = decode_tokens(rows[slots.clamp(min=0)], fmt)
    return torch.where(keep.unsqueeze(-1), decoded, torch.zeros((), device=decoded.device)).to(dtype)


def cache_rows(cache: torch.Tensor, spec: TokenFormat) -> torch.Tensor:
    """``cache`` viewed as ``[num_slots, bytes_per_token]`` (shares its storage)."""
    if cache.dtype != torch.uint8 or cache.dim() < 2 or cache.shape[-1] != spec.bytes_per_token:
        raise ValueError(f"cache must be uint8 [..., {spec.bytes_per_token}] for format {spec.name!r}, "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous to be addressed by flat slot; got strides "
                         f"{cache.stride()}")
    return cache.view(-1, spec.bytes_per_token)


def check_slots(slots: torch.Tensor, num_slots: int, dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> None:
    """``slots`` is ``[n]`` of one of ``dtypes`` (each in ``[-1, num_slots)`` under value checks)."""
    if slots.dim() != 1 or slots.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"slots must be {names} [n], got {slots.dtype} {tuple(slots.shape)}")
    if value_checks() and slots.numel() and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"slots must lie in [0, {num_slots}) or be -1 (skip); got values in "
                         f"[{slots.min().item()}, {slots.max().item()}]")


def _random_cache(gen: torch.Generator, fmt: str, blocks: int, block_size: int) -> torch.Tensor:
    """A cache whose every row holds a valid encoded token (so every row decodes to finite values)."""
    spec = TOKEN_FORMATS[fmt]
    tokens = torch.randn(blocks * block_size, spec.dim, generator=gen)
    return encode_tokens(tokens, fmt).reshape(blocks, block_size, spec.bytes_per_token)


def _slots(gen: torch.Generator, n: int, num_slots: int, skipped: int) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[torch.randperm(n, generator=gen)[:skipped]] = -1
    return slots


_E2M1_TIES = (6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _values(gen: torch.Generator, n: int, dim: int) -> torch.Tensor:
    """Rows with block magnitudes spread over many powers of two, one all-zero row and one row of
    e2m1 rounding ties (exact at FP4 scale 1)."""
    magnitude = torch.exp2(torch.randint(-6, 7, (n, dim // 16), generator=gen).float())
    x = torch.randn(n, dim, generator=gen) * magnitude.repeat_interleave(16, dim=1)
    x[0] = 0.0
    ties = torch.tensor(_E2M1_TIES)
    x[1] = torch.cat((ties, -ties)).repeat(dim // 16)
    return x


def _store_case(fmt: str, n: int, blocks: int, block_size: int, skipped: int):
    def make(gen: torch.Generator, device: torch.device):
        cache = _random_cache(gen, fmt, blocks, block_size)
        return {
            "cache": cache.to(device),
            "slots": _slots(gen, n, blocks * block_size, skipped).to(device),
            "x": _values(gen, n, TOKEN_FORMATS[fmt].dim).to(device),
            "fmt": fmt,
        }
    return make


def _load_case(fmt: str, n: int, blocks: int, block_size: int, skipped: int, narrow: bool = False):
    """``narrow``: int32 slots, decoded to bfloat16."""
    def make(gen: torch.Generator, device: torch.device):
        args = {
            "cache": _random_cache(gen, fmt, blocks, block_size).to(device),
            "slots": _slots(gen, n, blocks * block_size, skipped).to(device),
            "fmt": fmt,
        }
        if narrow:
            args.update(slots=args["slots"].int(), dtype=torch.bfloat16)
        return args
    return make


def _cases(make_case, dtype=torch.float32) -> tuple[OpCase, ...]:
    cases = []
    for fmt in TOKEN_FORMATS:
        cases.append(OpCase(f"tiny_{fmt}", make_case(fmt, 5, 3, 4, 1), dtype=dtype))
        cases.append(OpCase(f"real_{fmt}", make_case(fmt, 256, 4, 128, 7), size="real", dtype=dtype))
    return tuple(cases)


register(OpSpec(
    name="kv_store",
    summary="encode token rows in a cache format and write them at flat cache slots (in place)",
    reference=kv_store,
    cases=_cases(_store_case),
))

register(OpSpec(
    name="kv_load",
    summary="decode the cache rows at flat slots into float32 or bf16 (slot -1 gives zeros)",
    reference=kv_load,
    cases=_cases(_load_case, dtype=torch.bfloat16) + (  # float32 out unless asked, whatever the activations
        OpCase("tiny_index_fp4_int32_bf16", _load_case("index_fp4", 9, 3, 4, 2, narrow=True), dtype=torch.bfloat16),
        OpCase("tiny_fp8_int32_bf16", _load_case("fp8", 9, 3, 4, 2, narrow=True), dtype=torch.bfloat16),
        OpCase("real_fp4_int32_bf16", _load_case("fp4", 256, 4, 128, 7, narrow=True), size="real",
               dtype=torch.bfloat16)),
))


def kv_cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 values a reader of ``x [n, dim]`` stored in format ``fmt`` will see
    (encode then decode), so prefill can attend to exactly what decode reads back."""
    spec = token_format(fmt)
    if x.dim() != 2 or x.shape[1] != spec.dim or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [n, {spec.dim}] for format {fmt!r}, got {x.dtype} {tuple(x.shape)}")
    return decode_tokens(encode_tokens(x, fmt), fmt)


def _cast_case(fmt: str, n: int, *_):
    def make(gen: torch.Generator, device: torch.device):
        return {"x": _values(gen, n, TOKEN_FORMATS[fmt].dim).to(device), "fmt": fmt}
    return make


register(OpSpec(
    name="kv_cast",
    summary="quantize-dequantize token rows through a cache format (what a reader sees)",
    reference=kv_cast,
    cases=_cases(_cast_case),
))

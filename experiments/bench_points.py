"""The V4.1 op shapes that ``bench_ops.py`` times, with the bytes and FLOPs each must move and do.

Bytes count each input read once and each output written once (caches: only the selected rows);
FLOPs count multiply-adds as two. Inputs are random and valid in their formats (no NaN codes),
built directly on the GPU from a fresh generator per point (never the default one, which a failed
CUDA-graph capture leaves unusable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.hal.formats import Quantized
from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq

WINDOW, TOPK, HIDDEN, INTERMEDIATE, TOP_EXPERTS = 128, 512, 4096, 2048, 6
FP8_ROW, FP4_ROW = 528, 288


@dataclass(frozen=True)
class Point:
    """One timed configuration: ``build(ops)`` allocates inputs and returns the call to time."""

    op: str
    shape: str
    bytes: float
    flops: float
    build: Callable
    quick: bool = True
    with_reference: bool = False
    dense_shape: tuple[int, int, int] | None = None
    reps: int = 20
    note: str = ""
    gathered: float = 0.0
    """Bytes the op's gathers read when rows repeat across queries (reads served by L2 or HBM)."""
    fp8: bool = False
    """FP8 activations: the compute floor and the ``tc`` share take the dense FP8 rate."""


def _gen() -> torch.Generator:
    return torch.Generator("cuda").manual_seed(0)


def _fp8_rows(g, count: int) -> torch.Tensor:
    rows = torch.randint(0, 256, (count, FP8_ROW), dtype=torch.uint8, device="cuda", generator=g)
    data = rows[:, :512]
    data[(data & 0x7F) == 0x7F] -= 1  # e4m3fn NaN codes -> largest finite
    rows[:, 512:] = torch.randint(120, 128, (count, 16), dtype=torch.uint8, device="cuda", generator=g)
    return rows


def _fp4_rows(g, count: int) -> torch.Tensor:
    rows = torch.randint(0, 256, (count, FP4_ROW), dtype=torch.uint8, device="cuda", generator=g)
    rows[:, 256:] = torch.randint(0x30, 0x40, (count, 32), dtype=torch.uint8, device="cuda", generator=g)  # e4m3 0.125..0.9
    return rows


def _per_row_indices(g, batch: int, keys: int, region: int) -> torch.Tensor:
    """``int32 [batch, 1, keys]``: row ``b`` picks from its own ``region`` rows of the cache."""
    local = torch.randint(0, region, (batch, 1, keys), device="cuda", generator=g)
    return (local + torch.arange(batch, device="cuda")[:, None, None] * region).int()


def extra_region(batch: int, context: int) -> int:
    """Rows of the fp4 cache each decode query picks its top-k from (capped so all fit in 2^22 rows)."""
    return min(context // 4, (1 << 22) // batch)


def mla_decode(heads: int, batch: int, context: int, topk: int = TOPK, **kw) -> Point:
    region = extra_region(batch, context)

    def build(ops):
        g = _gen()
        args = dict(q=torch.randn(batch, 1, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g),
                    cache=_fp8_rows(g, batch * 2 * WINDOW), indices=_per_row_indices(g, batch, WINDOW, 2 * WINDOW),
                    extra_cache=_fp4_rows(g, batch * region),
                    extra_indices=_per_row_indices(g, batch, topk, region),
                    sink=torch.randn(heads, device="cuda", generator=g), scale=512 ** -0.5, cache_format="fp8",
                    extra_format="fp4")
        return lambda: ops.mla_sparse_decode(**args)

    keys = WINDOW + topk
    moved = batch * (WINDOW * FP8_ROW + topk * FP4_ROW + keys * 4 + 2 * heads * 512 * 2 + heads * 4)
    return Point("mla_sparse_decode", f"h={heads} B={batch} ctx={context} keys={WINDOW}+{topk} fp8+fp4", moved,
                 4.0 * batch * heads * keys * 512, build, **kw)


def mla_prefill(heads: int, tokens: int, kv_rows: int = 1 << 16, keys: int = WINDOW + TOPK, **kw) -> Point:
    def build(ops):
        g = _gen()
        args = dict(q=torch.randn(tokens, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g),
                    kv=torch.randn(kv_rows, 512, device="cuda", dtype=torch.bfloat16, generator=g),
                    indices=torch.randint(0, kv_rows, (tokens, keys), device="cuda", dtype=torch.int32, generator=g),
                    sink=torch.randn(heads, device="cuda", generator=g), scale=512 ** -0.5)
        return lambda: ops.mla_sparse_prefill(**args)

    moved = tokens * (2 * heads * 512 * 2 + keys * 4 + heads * 4) + min(kv_rows, tokens * keys) * 1024
    gathered = tokens * -(-heads // 64) * keys * 1024.0  # one gather per query row and 64-head block
    return Point("mla_sparse_prefill", f"h={heads} T={tokens} keys={keys} bf16 kv", moved,
                 4.0 * tokens * heads * keys * 512, build, reps=5, gathered=gathered, **kw)


BYTES_PER_VALUE = {"bf16": 2.0, "fp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32}
"""GEMM operand bytes per value, UE8M0 scale bytes (one per 32) included."""


def _gemm_operand(g, shape: tuple[int, ...], fmt: str, spread: float = 1.0):
    """bf16 normals, or random bytes valid in ``fmt`` (e4m3 without NaN codes, packed e2m1) with
    UE8M0 scales 2^-8 .. 2^-1, as a :class:`Quantized`."""
    if fmt == "bf16":
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * spread
    *lead, k = shape
    data = torch.randint(0, 256, (*lead, k // 2 if fmt == "mxfp4" else k), dtype=torch.uint8, device="cuda",
                         generator=g)
    if fmt == "fp8":
        data[(data & 0x7F) == 0x7F] -= 1  # e4m3fn NaN codes -> largest finite
        data = data.view(torch.float8_e4m3fn)
    scale = torch.randint(119, 127, (*lead, k // 32), dtype=torch.uint8, device="cuda", generator=g)
    return Quantized(data, scale, fmt, 32)


def gemm_bytes(experts: int, rows: int, n: int, k: int, x_format: str = "bf16", w_format: str = "bf16",
               out_bf16: bool = False) -> float:
    """Bytes a grouped GEMM must move: its rows, the weights of at most ``rows`` experts, the result
    (float32 for quantized operands unless ``out_bf16``)."""
    plain = x_format == w_format == "bf16"
    return (rows * k * BYTES_PER_VALUE[x_format] + min(experts, rows) * n * k * BYTES_PER_VALUE[w_format]
            + rows * n * (2 if plain or out_bf16 else 4))


def grouped(experts: int, rows: int, n: int, k: int, label: str, x_format: str = "bf16", w_format: str = "bf16",
            out_bf16: bool = False, **kw) -> Point:
    """A grouped GEMM point; ``out_bf16`` asks quantized operands for a bf16 result (the MoE's down
    projection)."""
    def build(ops):
        g = _gen()
        sizes = torch.bincount(torch.randint(0, experts, (rows,), device="cuda", generator=g), minlength=experts)
        x = _gemm_operand(g, (rows, k), x_format)
        w = _gemm_operand(g, (experts, n, k), w_format, k ** -0.5)
        if isinstance(w, Quantized):  # held as the model holds it: a parameter, which a backend may convert once
            w = Quantized(torch.nn.Parameter(w.data, requires_grad=False), w.scale, w.fmt, w.block)
        out_dtype = torch.bfloat16 if out_bf16 else None
        return lambda: ops.grouped_gemm(x, w, sizes, out_dtype=out_dtype)

    plain = x_format == w_format == "bf16"
    moved = gemm_bytes(experts, rows, n, k, x_format, w_format, out_bf16)
    formats = "" if plain else f" x={x_format} w={w_format}" + (" out=bf16" if out_bf16 else "")
    return Point("grouped_gemm", f"{label} E={experts} M={rows} N={n} K={k}{formats}", moved, 2.0 * rows * n * k,
                 build, dense_shape=(rows, n, k), reps=5, fp8=x_format == "fp8", **kw)


def rms(rows: int, dim: int, residual: bool, **kw) -> Point:
    def build(ops):
        g = _gen()
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        weight = torch.randn(dim, device="cuda", generator=g)
        res = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, generator=g) if residual else None
        return lambda: ops.rms_norm(x, weight, 1e-6, res)

    return Point("rms_norm", f"rows={rows} dim={dim}{' +residual' if residual else ''}",
                 rows * dim * 2.0 * (4 if residual else 2), 0.0, build, **kw)


def swa_keys(tokens: int, fmt: str = "fp8", **kw) -> Point:
    """Decode's SWA key store: one token per sequence, each into its own ring of ``2 * WINDOW`` rows."""
    row_bytes = FP8_ROW if fmt == "fp8" else 1024

    def build(ops):
        g = _gen()
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        weight = torch.randn(512, device="cuda", generator=g)
        positions = torch.randint(0, 1 << 16, (tokens,), device="cuda", generator=g)
        cos_sin = rope_cos_sin(rope_inv_freq(10000.0), 1 << 16).cuda()
        cache = torch.zeros(tokens * 2 * WINDOW, row_bytes, dtype=torch.uint8, device="cuda")
        slots = torch.arange(tokens, device="cuda") * 2 * WINDOW + positions % (2 * WINDOW)
        return lambda: ops.kv_norm_rope_store(x, weight, 1e-6, positions, cos_sin, cache, slots, fmt)

    moved = tokens * (512 * 2 + 8 + 8 + 64 * 4 + row_bytes + 512 * 2) + 512 * 4.0
    return Point("kv_norm_rope_store", f"T={tokens} {fmt} ring", moved, 0.0, build, **kw)


def _ep(experts: int, tokens: int, ranks: int) -> tuple[int, int]:
    """Experts and routed rows on one rank at expert parallelism ``ranks`` (balanced routing)."""
    return experts // ranks, tokens * TOP_EXPERTS // ranks


def _points() -> dict[str, Point]:
    points = {}
    for heads in (64, 128):
        for batch in (1, 16, 64, 256):
            for context in (4096, 65536):
                ref = heads == 64 and batch == 64 and context == 4096
                points[f"decode_h{heads}_b{batch}_c{context}"] = mla_decode(
                    heads, batch, context, with_reference=ref, quick=context == 65536 or ref)
        for tokens in (1024, 4096):
            points[f"prefill_h{heads}_t{tokens}"] = mla_prefill(heads, tokens,
                                                                with_reference=heads == 64 and tokens == 1024)
    for experts in (384, 256):
        for tokens, ranks in ((256, 1), (4096, 1), (256, 8), (4096, 8), (16384, 8)):
            e, m = _ep(experts, tokens, ranks)
            label = f"EP{ranks} T={tokens} w13"
            points[f"moe_e{experts}_t{tokens}_ep{ranks}"] = grouped(
                e, m, 2 * INTERMEDIATE, HIDDEN, label, quick=experts == 384,
                with_reference=experts == 384 and tokens == 4096 and ranks == 8)
        e, m = _ep(experts, 16384, 8)
        points[f"moe_e{experts}_t16384_ep8_w2"] = grouped(e, m, HIDDEN, INTERMEDIATE, "EP8 T=16384 w2",
                                                          quick=experts == 384)
    quant_formats = (("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "mxfp4"))
    for tokens, ranks in ((256, 1), (4096, 1), (256, 8), (4096, 8)):
        e, m = _ep(384, tokens, ranks)
        for x_format, w_format in quant_formats:
            points[f"moe_e384_t{tokens}_ep{ranks}_{x_format}_{w_format}"] = grouped(
                e, m, 2 * INTERMEDIATE, HIDDEN, f"EP{ranks} T={tokens} w13", x_format, w_format,
                quick=ranks == 8 and (tokens, x_format, w_format) in ((256, "fp8", "mxfp4"), (4096, "fp8", "fp8")))
    e, m = _ep(384, 65536, 8)
    for x_format, w_format in quant_formats:  # 1024 rows an expert: compute-bound for FP8 weights
        points[f"moe_e384_t65536_ep8_{x_format}_{w_format}"] = grouped(
            e, m, 2 * INTERMEDIATE, HIDDEN, "EP8 T=65536 w13", x_format, w_format, quick=False)
    e, m = _ep(384, 16384, 8)
    for x_format, w_format in quant_formats:
        points[f"moe_e384_t16384_ep8_w2_{x_format}_{w_format}"] = grouped(
            e, m, HIDDEN, INTERMEDIATE, "EP8 T=16384 w2", x_format, w_format, out_bf16=True,
            quick=(x_format, w_format) == ("fp8", "mxfp4"))
    e, m = _ep(384, 65536, 8)
    for x_format, w_format in quant_formats[:2]:  # 1024 rows an expert: w2 past the FP8 ridge (256 rows are not)
        points[f"moe_e384_t65536_ep8_w2_{x_format}_{w_format}"] = grouped(
            e, m, HIDDEN, INTERMEDIATE, "EP8 T=65536 w2", x_format, w_format, out_bf16=True, quick=False)
        points[f"moe_e384_t65536_ep8_w2_{x_format}_{w_format}_f32"] = grouped(
            e, m, HIDDEN, INTERMEDIATE, "EP8 T=65536 w2", x_format, w_format, quick=False)
    points["rms_hidden_256"] = rms(256, HIDDEN, True)
    points["rms_hidden_16384"] = rms(16384, HIDDEN, True, with_reference=True)
    points["rms_latent_4096"] = rms(4096, 512, False)
    for tokens in (1, 16, 64, 256):
        points[f"swa_keys_t{tokens}"] = swa_keys(tokens, quick=tokens in (1, 256), with_reference=tokens == 256)
    points["swa_keys_t256_bf16"] = swa_keys(256, "bf16", quick=False)
    return points


POINTS = _points()

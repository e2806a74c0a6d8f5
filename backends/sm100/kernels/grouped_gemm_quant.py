"""Grouped GEMM with block-scaled operands: bf16 or FP8 activations x FP8 or MXFP4 expert weights.

``y[seg e] = x[seg e] @ w[e].T`` over the contiguous expert segments of ``grouped_gemm.py`` (same
tile schedule, one compile per ``(experts, n, k, formats)``). Operands are the HAL's layouts:
e4m3 bytes ``[rows, k]`` or packed e2m1 bytes ``[rows, k / 2]`` (even index in the low nibble),
each with one UE8M0 byte per 32 values along K (value ``2 ** (byte - 127)``).

Each CTA first loads its rows' scale bytes for the whole K (one TMA when K is a multiple of 512;
the 4-byte slice of one K block would be too narrow for TMA). Per K block the raw tiles go to
shared memory (TMA, pipelined by a producer warpgroup), are decoded there to bf16 by the consumer
warpgroups and meet in a bf16 wgmma with a float32 accumulator. The decode is exact: e4m3 (4
significant bits) and e2m1 (2) times a power of two fit bf16 (8 bits, float32's exponent range),
so the result differs from the float32 reference only in summation order. Weight-bound (decode)
shapes read 1 byte (fp8) or half a byte (mxfp4) per weight instead of bf16's 2. The output is
float32, as the HAL returns for quantized operands. UE8M0 byte 0 (2^-127) decodes to 0 (float
bits ``b << 23``); quantization makes it only for blocks whose largest value is below 2^-118."""

import itertools

import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

BLOCK = 32
X_FORMATS = ("bf16", "fp8")
W_FORMATS = ("fp8", "mxfp4")
_STORAGE = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "mxfp4": "uint8"}


def _ue8m0(byte):
    """float32 value ``2 ** (byte - 127)`` of a UE8M0 byte: the byte as float32's exponent field."""
    return T.reinterpret(T.shift_left(T.cast(byte, "int32"), 23), "float")


def _value(raw, row, col, fmt: str, e2m1):
    """Unscaled float32 value at ``(row, col)`` of an e4m3 tile, or of a packed e2m1 tile through
    the 16-entry table ``e2m1``."""
    if fmt == "fp8":
        return T.cast(raw[row, col], "float")
    return e2m1[(raw[row, col // 2] >> ((col % 2) * 4)) & 15]


@tilelang.jit
def grouped_gemm_quant(experts: int, n: int, k: int, x_format: str, w_format: str, block_m: int = 128,
                       block_n: int = 128, block_k: int = 128, num_stages: int = 3, threads: int = 256,
                       swizzle: int = 8):
    """Kernel ``(x [m, k], x_scale uint8 [m, k/32], w [experts, n, k or k/2], w_scale uint8
    [experts, n, k/32], tile_expert, tile_row, tile_end [tiles], y float32 [m, n])``.

    ``x`` is bf16 (``x_format="bf16"``; ``x_scale`` is then unread, pass any ``uint8 [1, k/32]``)
    or e4m3 (``"fp8"``); ``w`` is e4m3 (``w_format="fp8"``) or packed e2m1 (``"mxfp4"``, uint8
    ``[experts, n, k/2]``). ``k`` a multiple of ``block_k``, itself a multiple of 32. ``m`` and
    ``tiles`` are dynamic; ``tile_expert[t] >= experts`` marks an empty tile."""
    if x_format not in X_FORMATS or w_format not in W_FORMATS:
        raise ValueError(f"formats x={x_format!r}, w={w_format!r}; expected x in {X_FORMATS}, w in {W_FORMATS}")
    if block_k % BLOCK or k % block_k:
        raise ValueError(f"k={k} must be a multiple of block_k={block_k}, itself a multiple of {BLOCK}")
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    per_byte = 2 if w_format == "mxfp4" else 1
    groups = block_k // BLOCK
    x_scale_rows = m if x_format == "fp8" else 1

    @T.macro
    def decode_tile(raw, scale_s, tile, fmt, kb, e2m1):
        """``tile`` (bf16) from K block ``kb``'s raw bytes and the rows' scale bytes."""
        for i, v in T.Parallel(tile.shape[0], block_k // 8):
            for e in T.vectorized(8):
                tile[i, v * 8 + e] = T.cast(_value(raw, i, v * 8 + e, fmt, e2m1)
                                            * _ue8m0(scale_s[i, kb * groups + v * 8 // BLOCK]), "bfloat16")

    @T.prim_func
    def kernel(x: T.Tensor((m, k), _STORAGE[x_format]), x_scale: T.Tensor((x_scale_rows, k // BLOCK), "uint8"),
               w: T.Tensor((experts, n, k // per_byte), _STORAGE[w_format]),
               w_scale: T.Tensor((experts, n, k // BLOCK), "uint8"), tile_expert: T.Tensor((tiles,), "int32"),
               tile_row: T.Tensor((tiles,), "int32"), tile_end: T.Tensor((tiles,), "int32"),
               y: T.Tensor((m, n), "float")):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=threads) as (bn, bt):
            x_raw = T.alloc_shared((block_m, block_k), _STORAGE[x_format])
            x_scale_s = T.alloc_shared((block_m, k // BLOCK), "uint8")
            x_tile = T.alloc_shared((block_m, block_k), "bfloat16")
            w_raw = T.alloc_shared((block_n, block_k // per_byte), _STORAGE[w_format])
            w_scale_s = T.alloc_shared((block_n, k // BLOCK), "uint8")
            w_tile = T.alloc_shared((block_n, block_k), "bfloat16")
            e2m1 = T.alloc_shared((16,), "float")
            acc = T.alloc_fragment((block_m, block_n), "float")
            T.use_swizzle(panel_size=swizzle)
            if tile_expert[bt] < experts:
                if w_format == "mxfp4":
                    for c in T.Parallel(16):  # e2m1 code -> value: 0, .5, 1, 1.5, 2, 3, 4, 6 (bit 3: sign)
                        e2m1[c] = T.if_then_else(
                            (c & 6) == 0, 0.5 * (c & 1),
                            (1.0 + 0.5 * (c & 1)) * T.cast(T.shift_left(1, ((c & 6) >> 1) - 1), "float")) \
                            * T.if_then_else(c >= 8, -1.0, 1.0)
                T.clear(acc)
                T.copy(w_scale[tile_expert[bt], bn * block_n:(bn + 1) * block_n, :], w_scale_s)
                if x_format == "fp8":
                    T.copy(x_scale[tile_row[bt]:tile_row[bt] + block_m, :], x_scale_s)
                for kb in T.Pipelined(k // block_k, num_stages=num_stages):
                    T.copy(w[tile_expert[bt], bn * block_n:(bn + 1) * block_n,
                             kb * block_k // per_byte:(kb + 1) * block_k // per_byte], w_raw)
                    if x_format == "fp8":
                        T.copy(x[tile_row[bt]:tile_row[bt] + block_m, kb * block_k:(kb + 1) * block_k], x_raw)
                        decode_tile(x_raw, x_scale_s, x_tile, x_format, kb, e2m1)
                    else:
                        T.copy(x[tile_row[bt]:tile_row[bt] + block_m, kb * block_k:(kb + 1) * block_k], x_tile)
                    decode_tile(w_raw, w_scale_s, w_tile, w_format, kb, e2m1)
                    T.gemm(x_tile, w_tile, acc, transpose_B=True)
                for i, j in T.Parallel(block_m, block_n):
                    if i < tile_end[bt] - tile_row[bt]:
                        y[tile_row[bt] + i, bn * block_n + j] = acc[i, j]

    return kernel


def decode(data: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """The kernel's decode in torch: bf16 values of ``data [..., k]`` (or packed ``[..., k/2]``
    for ``"mxfp4"``) with UE8M0 ``scale [..., k/32]``, built the way the kernel builds them
    (scale bytes as float32 exponent bits, a 16-entry e2m1 table, one rounding to bf16)."""
    if fmt == "bf16":
        return data
    scale_value = (scale.to(torch.int32) << 23).view(torch.float32)
    if fmt == "mxfp4":
        table = torch.tensor((0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6), device=data.device)
        values = table[torch.stack((data & 15, data >> 4), dim=-1).flatten(-2).long()]
    else:
        values = data.float()
    blocks = values.unflatten(-1, (-1, BLOCK)) * scale_value.unsqueeze(-1)
    return blocks.flatten(-2).to(torch.bfloat16)


def reference(x, x_scale, w, w_scale, group_sizes, x_format: str, w_format: str) -> torch.Tensor:
    """float32 ``y`` from the decoded operands, one float32 matmul per expert segment."""
    xs, ws = decode(x, x_scale, x_format).float(), decode(w, w_scale, w_format).float()
    out, start = torch.zeros(xs.shape[0], ws.shape[1], device=xs.device), 0
    for expert, size in enumerate(group_sizes.tolist()):
        out[start:start + size] = xs[start:start + size] @ ws[expert].T
        start += size
    return out


def run(x, x_scale, w, w_scale, group_sizes, x_format: str, w_format: str, **tiles) -> torch.Tensor:
    """Compile (cached by shape) and launch on ``x``'s device; ``x_scale`` may be ``None`` for bf16 x."""
    experts, n, k = w.shape[0], w.shape[1], w_scale.shape[2] * BLOCK
    if x_scale is None:
        x_scale = torch.zeros(1, k // BLOCK, dtype=torch.uint8, device=x.device)
    schedule = tile_schedule(group_sizes, x.shape[0], tiles.get("block_m", 128))
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        kernel = grouped_gemm_quant(experts, n, k, x_format, w_format, **tiles)
        kernel(x, x_scale, w, w_scale, schedule[0], schedule[1], schedule[2], y)
    return y


def main(experts: int = 8, n: int = 4096, k: int = 4096) -> None:
    """Check every format pair against :func:`reference` and time it on the current GPU, at 512
    rows per expert (compute-bound, 128-row tiles) and 4 (weight-bound, 64-row tiles)."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.formats import quantize

    gen = torch.Generator().manual_seed(0)
    w_plain = (k ** -0.5 * torch.randn(experts, n, k, generator=gen)).cuda()
    weights = {fmt: quantize(w_plain, fmt) for fmt in W_FORMATS}
    for rows_per_expert, tiles in ((512, {}), (4, {"block_m": 64})):
        sizes = torch.full((experts,), rows_per_expert, dtype=torch.int64, device="cuda")
        x_plain = torch.randn(experts * rows_per_expert, k, generator=gen).cuda()
        x_fp8 = quantize(x_plain, "fp8")
        activations = {"bf16": (x_plain.to(torch.bfloat16), None), "fp8": (x_fp8.data, x_fp8.scale)}
        for (x_format, (x, x_scale)), w_format in itertools.product(activations.items(), W_FORMATS):
            w, w_scale = weights[w_format].data, weights[w_format].scale
            args = (x, x_scale, w, w_scale, sizes, x_format, w_format)
            torch.testing.assert_close(run(*args, **tiles), reference(*args), atol=1e-3, rtol=1e-3)
            ms = do_bench(lambda: run(*args, **tiles))
            scale_bytes = w_scale.nbytes + (0 if x_scale is None else x_scale.nbytes)
            moved = x.nbytes + w.nbytes + scale_bytes + 4 * x.shape[0] * n
            print(f"grouped_gemm_quant x={x_format} w={w_format} m={x.shape[0]} n={n} k={k} experts={experts}: "
                  f"{ms:.3f} ms, {2 * x.shape[0] * n * k / ms / 1e9:.1f} TFLOP/s, {moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()

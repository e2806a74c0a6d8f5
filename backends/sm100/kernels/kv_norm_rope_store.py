"""RMSNorm -> RoPE -> quantize -> store of one cache row per token (HAL ``kv_norm_rope_store``), one CTA per token.

Each of the CTA's ``dim / 4`` threads holds 4 consecutive values of the token: an interleaved
RoPE pair lies in one thread, a scale block of 16 or 32 values in 4 or 8 neighbouring lanes (its
max by shuffles), and the sum of squares goes over shuffles and one shared word per warp. The
arithmetic follows the reference op by op, so the result is the reference's bit for bit except
where the float32 sum of squares, taken in another order, rounds differently (then a value may
move by one ulp of ``x``'s dtype, and rarely a quantized code with it):

* RMSNorm in float32: ``x * (1 / sqrt(mean(x^2) + eps)) * w`` (IEEE sqrt and division, as torch
  on a CPU), rounded to ``x``'s dtype (bf16 or float32);
* RoPE on the trailing ``rope_dim`` dims, interleaved pairs ``(2i, 2i + 1)`` turned by
  ``cos_sin[position, i]`` and ``cos_sin[position, rope_dim / 2 + i]``, each product and sum
  rounded on its own (no FMA contraction, as torch), rounded to ``x``'s dtype;
* UE8M0 scales (``fp8`` per 32 over e4m3's 448, ``index_fp4`` per 32 over e2m1's 6): the block
  max floored (``fp8`` at 1e-4, ``index_fp4`` at ``6 * 2^-126``), divided by the element max
  (IEEE), rounded up to a power of two from the quotient's bits; values are multiplied by the
  exact ``1 / s``;
* ``fp4`` e4m3 scales per 16: ``e4m3(max(amax, 6 * 2^-9) * (1 / 6))`` (float32 product, round to
  nearest even), values multiplied by its IEEE reciprocal;
* e4m3 codes: clamp to +-448, round to nearest even; e2m1 codes: round to nearest, ties to the
  even code (the thresholds of ``formats.e2m1_codes``), the value's sign bit kept (``-0`` is
  ``0x8``), two per byte, even index low;
* the row (data, then scale bytes) goes to cache row ``slots[token]`` (``-1``, or a row past the
  cache: not stored) and ``y`` gets the decoded values ``code * s`` (exact in bf16); ``bf16``
  rows hold the keys rounded to bf16 (the cache viewed as ``bf16 [rows, dim]``).
"""
import tilelang
import tilelang.language as T
import torch

from deepinfer.hal.formats import FP8_AMAX_FLOOR, MXFP4_AMAX_FLOOR, NVFP4_AMAX_FLOOR

FORMATS = {  # name: (dim, values per scale, scale kind, element kind)
    "fp8": (512, 32, "ue8m0", "e4m3"),
    "bf16": (512, 32, None, "bf16"),
    "fp4": (512, 16, "e4m3", "e2m1"),
    "index_fp4": (128, 32, "ue8m0", "e2m1"),
}
X_DTYPES = ("bfloat16", "float32")
ELEMENT_MAX = {"e4m3": 448.0, "e2m1": 6.0}
AMAX_FLOOR = {"fp8": FP8_AMAX_FLOOR, "index_fp4": MXFP4_AMAX_FLOOR, "fp4": NVFP4_AMAX_FLOOR}
"""The least block max a scale is taken from, per format."""
VEC = 4
"""Values per thread."""


@tilelang.jit
def kv_norm_rope_store(dim: int = 512, rope_dim: int = 64, eps: float = 1e-6, fmt: str = "fp8",
                       x_dtype: str = "bfloat16"):
    """Kernel ``(x [tokens, dim], weight f32 [dim], positions i64 [tokens], cos_sin f32 [table,
    rope_dim], slots i64 [tokens], cache, y [tokens, dim])``, ``x`` and ``y`` in ``x_dtype``;
    ``cache`` is ``uint8 [rows, bytes_per_token]``, or ``bf16 [rows, dim]`` for ``bf16``.
    ``tokens``, ``table`` and ``rows`` are dynamic."""
    if fmt not in FORMATS or FORMATS[fmt][0] != dim or x_dtype not in X_DTYPES or rope_dim % (2 * VEC) \
            or not 0 < rope_dim <= dim:
        dims = {name: layout[0] for name, layout in FORMATS.items()}
        raise ValueError(f"kv_norm_rope_store: fmt {fmt!r} and dim={dim} must be one of {dims}; x_dtype {x_dtype!r} "
                         f"one of {X_DTYPES}; rope_dim={rope_dim} a positive multiple of {2 * VEC}, at most dim")
    _, block, scale_kind, element = FORMATS[fmt]
    threads = dim // VEC
    tokens, table, rows = T.dynamic("tokens"), T.dynamic("table"), T.dynamic("rows")
    warps, lanes_per_block, rope_start = threads // 32, block // VEC, dim - rope_dim
    shuffle_offsets = [lanes_per_block >> i for i in range(1, lanes_per_block.bit_length())]  # 4, 2, 1 or 2, 1
    data_bytes = dim // 2 if element == "e2m1" else dim
    cache_shape, cache_dtype = ((rows, dim), "bfloat16") if fmt == "bf16" \
        else ((rows, data_bytes + dim // block), "uint8")

    @T.macro
    def to_x(value):
        """``value`` rounded to ``x``'s dtype (as the reference's ``.to(x.dtype)``), as float32."""
        return T.cast(T.cast(value, "bfloat16"), "float") if x_dtype == "bfloat16" else value

    @T.macro
    def pow2(exponent):
        """``2 ** exponent`` for an int32 exponent in [-126, 127]."""
        return T.reinterpret(T.shift_left(exponent + 127, 23), "float")

    @T.macro
    def e2m1_code(value):
        """4-bit e2m1 code of ``value`` (sign in bit 3): nearest, ties to the even code."""
        a = T.abs(value)
        magnitude = (T.if_then_else(a > 0.25, 1, 0) + T.if_then_else(a >= 0.75, 1, 0)
                     + T.if_then_else(a > 1.25, 1, 0) + T.if_then_else(a >= 1.75, 1, 0)
                     + T.if_then_else(a > 2.5, 1, 0) + T.if_then_else(a >= 3.5, 1, 0) + T.if_then_else(a > 5.0, 1, 0))
        return magnitude | T.if_then_else(T.reinterpret(value, "int32") < 0, 8, 0)

    @T.macro
    def e2m1_value(code):
        """float32 value of a 4-bit e2m1 code: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
        magnitude = code & 7
        value = T.if_then_else(magnitude < 2, T.cast(magnitude, "float") * 0.5,
                               (1.0 + 0.5 * T.cast(magnitude & 1, "float")) * pow2(T.shift_right(magnitude, 1) - 1))
        return T.if_then_else((code & 8) > 0, -value, value)

    @T.prim_func
    def kernel(x: T.Tensor((tokens, dim), x_dtype), weight: T.Tensor((dim,), "float"),
               positions: T.Tensor((tokens,), "int64"), cos_sin: T.Tensor((table, rope_dim), "float"),
               slots: T.Tensor((tokens,), "int64"), cache: T.Tensor(cache_shape, cache_dtype),
               y: T.Tensor((tokens, dim), x_dtype)):
        with T.Kernel(tokens, threads=threads) as token:
            tx = T.get_thread_binding()
            first = tx * VEC
            values = T.alloc_local((VEC,), "float")
            warp_sums = T.alloc_shared((warps,), "float")
            total = T.alloc_var("float")
            inv_rms = T.alloc_var("float")
            slot = T.alloc_var("int64")

            for k in T.vectorized(VEC):
                values[k] = T.cast(x[token, first + k], "float")
            total = 0.0
            for k in T.serial(VEC):
                total += values[k] * values[k]
            total = T.warp_reduce_sum(total)
            if tx % 32 == 0:
                warp_sums[tx // 32] = total
            T.sync_threads()
            total = 0.0
            for w in T.serial(warps):
                total += warp_sums[w]
            inv_rms = T.ieee_fdiv(1.0, T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(total, float(dim)), eps)))
            for k in T.serial(VEC):
                values[k] = to_x(T.ieee_mul(T.ieee_mul(values[k], inv_rms), weight[first + k]))

            if first >= rope_start:
                rotated = T.alloc_local((VEC,), "float")
                position = positions[token]
                for p in T.serial(VEC // 2):
                    pair = (first - rope_start) // 2 + p
                    cos, sin = cos_sin[position, pair], cos_sin[position, rope_dim // 2 + pair]
                    even, odd = values[2 * p], values[2 * p + 1]
                    rotated[2 * p] = to_x(T.ieee_sub(T.ieee_mul(even, cos), T.ieee_mul(odd, sin)))
                    rotated[2 * p + 1] = to_x(T.ieee_add(T.ieee_mul(even, sin), T.ieee_mul(odd, cos)))
                for k in T.serial(VEC):
                    values[k] = rotated[k]

            slot = slots[token]
            if fmt == "bf16":
                for k in T.vectorized(VEC):
                    y[token, first + k] = T.cast(T.cast(values[k], "bfloat16"), x_dtype)
                if slot >= 0 and slot < rows:
                    for k in T.vectorized(VEC):
                        cache[slot, first + k] = T.cast(values[k], "bfloat16")
            else:
                amax = T.alloc_var("float")
                scale = T.alloc_var("float")
                scale_byte = T.alloc_var("uint8")
                codes = T.alloc_local((VEC,), "uint8")
                amax = 0.0
                for k in T.serial(VEC):
                    amax = T.max(amax, T.abs(values[k]))
                for offset in shuffle_offsets:
                    amax = T.max(amax, T.shfl_xor(amax, offset))
                if scale_kind == "ue8m0":
                    # the least power of two at or above the floored quotient, from its bits
                    bits = T.alloc_var("int32")
                    exponent = T.alloc_var("int32")
                    bits = T.reinterpret(T.ieee_fdiv(T.max(amax, AMAX_FLOOR[fmt]), ELEMENT_MAX[element]), "int32")
                    exponent = T.shift_right(bits - 1, 23) + 1 - 127
                    scale = pow2(exponent)
                    scale_byte = T.cast(exponent + 127, "uint8")
                    for k in T.serial(VEC):
                        scaled = values[k] * pow2(-exponent)  # exact: a power of two in range
                        if element == "e4m3":
                            codes[k] = T.reinterpret(T.cast(T.max(T.min(scaled, 448.0), -448.0), "float8_e4m3fn"),
                                                     "uint8")
                        else:
                            codes[k] = T.cast(e2m1_code(scaled), "uint8")
                else:
                    inverse = T.alloc_var("float")
                    scale = T.cast(T.cast(T.min(T.ieee_mul(T.max(amax, AMAX_FLOOR[fmt]), 1.0 / 6.0), 448.0),
                                          "float8_e4m3fn"), "float")
                    scale_byte = T.reinterpret(T.cast(scale, "float8_e4m3fn"), "uint8")
                    inverse = T.ieee_fdiv(1.0, scale)
                    for k in T.serial(VEC):
                        codes[k] = T.cast(e2m1_code(T.ieee_mul(values[k], inverse)), "uint8")
                for k in T.vectorized(VEC):
                    if element == "e4m3":
                        y[token, first + k] = T.cast(T.cast(T.reinterpret(codes[k], "float8_e4m3fn"), "float")
                                                     * scale, x_dtype)
                    else:
                        y[token, first + k] = T.cast(e2m1_value(T.cast(codes[k], "int32")) * scale, x_dtype)
                if slot >= 0 and slot < rows:
                    if element == "e4m3":
                        for k in T.vectorized(VEC):
                            cache[slot, first + k] = codes[k]
                    else:
                        for k in T.serial(VEC // 2):
                            cache[slot, first // 2 + k] = codes[2 * k] | T.shift_left(codes[2 * k + 1], 4)
                    if tx % lanes_per_block == 0:
                        cache[slot, data_bytes + first // block] = scale_byte

    return kernel


def main(tokens: int = 256, bench: bool = True) -> None:
    """Check every format with bf16 and float32 ``x`` against the HAL reference (the stored bytes,
    the returned copy, rows left alone), then time bf16 ``x`` against the bytes each call moves."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.formats import decode_tokens, token_format
    from deepinfer.hal.ops.kv_norm_rope_store import kv_norm_rope_store as reference
    from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq
    from deepinfer.hal.spec import SPECS, compare
    from deepinfer_backends.sm100.wrappers import kv_norm_rope_store as run

    def inputs(count: int, fmt: str, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(count)
        dim = token_format(fmt).dim
        slots = torch.randperm(2 * count, generator=gen)[:count]
        slots[::7] = -1
        x = torch.randn(count, dim, generator=gen) * torch.exp2(torch.randint(-3, 4, (count, 1), generator=gen))
        x[1::5, :32] = 0.0  # all-zero scale blocks
        return (x.to(dtype), 1 + 0.1 * torch.randn(dim, generator=gen), 1e-6,
                torch.randint(0, 1 << 16, (count,), generator=gen), rope_cos_sin(rope_inv_freq(10000.0), 1 << 16),
                torch.zeros(2 * count, token_format(fmt).bytes_per_token, dtype=torch.uint8), slots, fmt)

    for fmt in FORMATS:
        for dtype in (torch.bfloat16, torch.float32):
            args = inputs(tokens, fmt, dtype)
            want = reference(*args)
            want_cache, slots = args[5], args[6]
            cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
            cuda_args[5] = torch.zeros_like(cuda_args[5])
            got, stored = run(*cuda_args).cpu(), cuda_args[5].cpu()
            kept, name = slots[slots >= 0], f"kv_norm_rope_store/{fmt}/{str(dtype)[6:]}"
            assert got.dtype == dtype and torch.equal(decode_tokens(stored[kept], fmt), got[slots >= 0].float()), \
                f"{name}: the stored rows do not decode to the returned copy"
            untouched = torch.ones(stored.shape[0], dtype=torch.bool)
            untouched[kept] = False
            assert not stored[untouched].any(), f"{name}: rows outside the kept slots were written"
            differing = (stored[kept] != want_cache[kept]).sum().item()
            failures = compare(got, want, SPECS["kv_norm_rope_store"].tolerance(dtype), name)
            print(f"{name}: {differing} of {stored[kept].numel()} stored bytes differ from the reference's (a "
                  f"float32 sum in another order can move a value by an ulp); max |y - ref| "
                  f"{(got.float() - want.float()).abs().max().item():.3g}")
            assert not failures and differing <= 1e-4 * stored[kept].numel(), failures or f"{name}: bytes differ"
    for count in (1, 64, 256, 4096, 16384) if bench else ():
        for fmt in FORMATS:
            cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in inputs(count, fmt, torch.bfloat16)]
            ms = do_bench(lambda: run(*cuda_args))
            dim = token_format(fmt).dim
            moved = count * (dim * 2 + 8 + 8 + 64 * 4 + token_format(fmt).bytes_per_token + dim * 2) + dim * 4
            print(f"kv_norm_rope_store {fmt} tokens={count}: {ms * 1e3:.1f} us, {moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    import sys

    main(bench="--no-bench" not in sys.argv[1:])

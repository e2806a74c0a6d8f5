"""RMSNorm -> RoPE -> quantize -> store of SWA keys (HAL ``kv_norm_rope_store``), one CTA per token.

Each of the CTA's threads holds ``dim / threads`` consecutive values of the token (4 of 512 with
128 threads): an interleaved RoPE pair lies in one thread, a 32-value scale block in 8
neighbouring lanes (its max by shuffles), and the sum of squares goes over shuffles and one
shared word per warp. The arithmetic follows the reference op by op, so the result is the
reference's bit for bit except where the float32 sum of squares, taken in another order, rounds
differently (then a bf16 rounding, and rarely an e4m3 one, may flip):

* RMSNorm in float32: ``x * (1 / sqrt(mean(x^2) + eps)) * w`` (IEEE sqrt and division, as torch
  on a CPU), rounded to bf16 (the op's dtype);
* RoPE on the trailing ``rope_dim`` dims, interleaved pairs ``(2i, 2i + 1)`` turned by
  ``cos_sin[position, i]`` and ``cos_sin[position, rope_dim / 2 + i]``, each product and sum
  rounded on its own (no FMA contraction, as torch), rounded to bf16;
* ``fp8``: per 32 values the smallest power of two ``s`` with ``amax / s <= 448``, from the
  bits of ``amax`` (exact for bf16 values; zero block: ``s = 1``), UE8M0 byte ``127 + log2 s``,
  e4m3 of ``value / s`` (a product with ``1 / s``, as exact) clamped to +-448 and rounded to
  nearest even. The 528-byte row (512 e4m3, 16 scales) goes to cache row ``slots[token]``
  (``-1``, or a row past the cache: not stored), and ``y`` gets the decoded values ``e4m3 * s``
  (exact in bf16);
* ``bf16``: the bf16 keys go to the cache row (viewed as ``bf16 [rows, dim]``) and to ``y``.
"""
import tilelang
import tilelang.language as T
import torch

SCALE_BLOCK = 32
E4M3_MAX = 448.0
FORMATS = ("fp8", "bf16")


@tilelang.jit
def kv_norm_rope_store(dim: int = 512, rope_dim: int = 64, eps: float = 1e-6, fmt: str = "fp8", threads: int = 128):
    """Kernel ``(x bf16 [tokens, dim], weight f32 [dim], positions i64 [tokens], cos_sin f32
    [table, rope_dim], slots i64 [tokens], cache, y bf16 [tokens, dim])``; ``cache`` is ``uint8
    [rows, dim + dim / 32]`` for ``fp8``, ``bf16 [rows, dim]`` for ``bf16``. ``tokens``,
    ``table`` and ``rows`` are dynamic."""
    vec = dim // threads
    if fmt not in FORMATS or dim % threads or vec % 2 or SCALE_BLOCK % vec or threads % 32 \
            or rope_dim % (2 * vec) or not 0 < rope_dim <= dim or dim % SCALE_BLOCK:
        raise ValueError(f"kv_norm_rope_store: fmt {fmt!r} must be one of {FORMATS}; dim={dim} must split into "
                         f"threads={threads} (a multiple of 32) runs of an even count dividing {SCALE_BLOCK}; "
                         f"rope_dim={rope_dim} must be a positive multiple of twice that count, at most dim")
    tokens, table, rows = T.dynamic("tokens"), T.dynamic("table"), T.dynamic("rows")
    warps, lanes_per_block, rope_start = threads // 32, SCALE_BLOCK // vec, dim - rope_dim
    shuffle_offsets = [lanes_per_block >> i for i in range(1, lanes_per_block.bit_length())]  # 4, 2, 1
    cache_shape, cache_dtype = ((rows, dim + dim // SCALE_BLOCK), "uint8") if fmt == "fp8" \
        else ((rows, dim), "bfloat16")

    @T.macro
    def to_bf16(value):
        return T.cast(T.cast(value, "bfloat16"), "float")

    @T.macro
    def pow2(exponent):
        """``2 ** exponent`` for an int32 exponent in [-127, 127] (2^-127 is subnormal)."""
        return T.reinterpret(T.if_then_else(exponent > -127, T.shift_left(exponent + 127, 23), 0x400000), "float")

    @T.prim_func
    def kernel(x: T.Tensor((tokens, dim), "bfloat16"), weight: T.Tensor((dim,), "float"),
               positions: T.Tensor((tokens,), "int64"), cos_sin: T.Tensor((table, rope_dim), "float"),
               slots: T.Tensor((tokens,), "int64"), cache: T.Tensor(cache_shape, cache_dtype),
               y: T.Tensor((tokens, dim), "bfloat16")):
        with T.Kernel(tokens, threads=threads) as token:
            tx = T.get_thread_binding()
            first = tx * vec
            values = T.alloc_local((vec,), "float")
            warp_sums = T.alloc_shared((warps,), "float")
            total = T.alloc_var("float")
            inv_rms = T.alloc_var("float")
            slot = T.alloc_var("int64")

            for k in T.vectorized(vec):
                values[k] = T.cast(x[token, first + k], "float")
            total = 0.0
            for k in T.serial(vec):
                total += values[k] * values[k]
            total = T.warp_reduce_sum(total)
            if tx % 32 == 0:
                warp_sums[tx // 32] = total
            T.sync_threads()
            total = 0.0
            for w in T.serial(warps):
                total += warp_sums[w]
            inv_rms = T.ieee_fdiv(1.0, T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(total, float(dim)), eps)))
            for k in T.serial(vec):
                values[k] = to_bf16(T.ieee_mul(T.ieee_mul(values[k], inv_rms), weight[first + k]))

            if first >= rope_start:
                rotated = T.alloc_local((vec,), "float")
                position = positions[token]
                for p in T.serial(vec // 2):
                    pair = (first - rope_start) // 2 + p
                    cos, sin = cos_sin[position, pair], cos_sin[position, rope_dim // 2 + pair]
                    even, odd = values[2 * p], values[2 * p + 1]
                    rotated[2 * p] = to_bf16(T.ieee_sub(T.ieee_mul(even, cos), T.ieee_mul(odd, sin)))
                    rotated[2 * p + 1] = to_bf16(T.ieee_add(T.ieee_mul(even, sin), T.ieee_mul(odd, cos)))
                for k in T.serial(vec):
                    values[k] = rotated[k]

            slot = slots[token]
            if fmt == "bf16":
                for k in T.vectorized(vec):
                    y[token, first + k] = T.cast(values[k], "bfloat16")
                if slot >= 0 and slot < rows:
                    for k in T.vectorized(vec):
                        cache[slot, first + k] = T.cast(values[k], "bfloat16")
            else:
                amax = T.alloc_var("float")
                exponent = T.alloc_var("int32")
                codes = T.alloc_local((vec,), "uint8")
                amax = 0.0
                for k in T.serial(vec):
                    amax = T.max(amax, T.abs(values[k]))
                for offset in shuffle_offsets:
                    amax = T.max(amax, T.shfl_xor(amax, offset))
                # amax = 1.m * 2^e: s = 2^(e - 8) when 1.m <= 1.75 (448 = 1.75 * 2^8), else 2^(e - 7)
                bits = T.reinterpret(amax, "int32")
                exponent = T.shift_right(bits, 23) - 135 + T.if_then_else((bits & 0x7FFFFF) > 0x600000, 1, 0)
                exponent = T.if_then_else(amax > 0, T.max(T.min(exponent, 127), -127), 0)
                for k in T.serial(vec):
                    codes[k] = T.reinterpret(T.cast(T.max(T.min(values[k] * pow2(-exponent), E4M3_MAX), -E4M3_MAX),
                                                    "float8_e4m3fn"), "uint8")
                for k in T.vectorized(vec):
                    y[token, first + k] = T.cast(T.cast(T.reinterpret(codes[k], "float8_e4m3fn"), "float")
                                                 * pow2(exponent), "bfloat16")
                if slot >= 0 and slot < rows:
                    for k in T.vectorized(vec):
                        cache[slot, first + k] = codes[k]
                    if tx % lanes_per_block == 0:
                        cache[slot, dim + first // SCALE_BLOCK] = T.cast(exponent + 127, "uint8")

    return kernel


def main(tokens: int = 256) -> None:
    """Check both formats against the HAL reference (the stored bytes, the returned copy, rows left
    alone) and time them against the bytes they must move, for decode and prefill token counts."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.formats import decode_tokens, token_format
    from deepinfer.hal.ops.kv_norm_rope_store import kv_norm_rope_store as reference
    from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq
    from deepinfer.hal.spec import SPECS, compare
    from deepinfer_backends.sm100.wrappers import kv_norm_rope_store as run

    def inputs(count: int, fmt: str):
        gen = torch.Generator().manual_seed(count)
        slots = torch.randperm(2 * count, generator=gen)[:count]
        slots[::7] = -1
        return (torch.randn(count, 512, generator=gen).to(torch.bfloat16), 1 + 0.1 * torch.randn(512, generator=gen),
                1e-6, torch.randint(0, 1 << 16, (count,), generator=gen), rope_cos_sin(rope_inv_freq(10000.0), 1 << 16),
                torch.zeros(2 * count, token_format(fmt).bytes_per_token, dtype=torch.uint8), slots, fmt)

    tolerance = SPECS["kv_norm_rope_store"].tolerance(torch.bfloat16)
    for fmt in FORMATS:
        args = inputs(tokens, fmt)
        want = reference(*args)
        want_cache, slots = args[5], args[6]
        cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        cuda_args[5] = torch.zeros_like(cuda_args[5])
        got, stored = run(*cuda_args).cpu(), cuda_args[5].cpu()
        kept = slots[slots >= 0]
        assert torch.equal(decode_tokens(stored[kept], fmt), got[slots >= 0].float()), \
            f"{fmt}: the stored rows do not decode to the returned copy"
        untouched = torch.ones(stored.shape[0], dtype=torch.bool)
        untouched[kept] = False
        assert not stored[untouched].any(), f"{fmt}: rows outside the kept slots were written"
        differing = (stored[kept] != want_cache[kept]).sum().item()
        failures = compare(got, want, tolerance, f"kv_norm_rope_store/{fmt}")
        print(f"{fmt}: {differing} of {stored[kept].numel()} stored bytes differ from the reference's (a float32 "
              f"sum in another order can flip a bf16 rounding); max |y - ref| "
              f"{(got.float() - want.float()).abs().max().item():.3g}")
        assert not failures and differing <= 1e-4 * stored[kept].numel(), failures or f"{fmt}: bytes differ"
    for count in (1, 64, 256, 4096, 16384):
        for fmt in FORMATS:
            cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in inputs(count, fmt)]
            ms = do_bench(lambda: run(*cuda_args))
            moved = count * (512 * 2 + 8 + 8 + 64 * 4 + token_format(fmt).bytes_per_token + 512 * 2) + 512 * 4
            print(f"kv_norm_rope_store {fmt} tokens={count}: {ms * 1e3:.1f} us, {moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()

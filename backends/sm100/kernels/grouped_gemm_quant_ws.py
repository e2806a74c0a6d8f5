"""Warp-specialised block-scaled grouped GEMM on Hopper: bf16 activations x FP8 or MXFP4 expert weights.

Same contract as :func:`~deepinfer_backends.sm100.kernels.grouped_gemm_quant.grouped_gemm_quant`
(contiguous expert segments, UE8M0 scales per 32 along K, exact decode to bf16, bf16 wgmma,
float32 result), with the decode taken off the tensor cores' critical path:

- FP8 activations are decoded to bf16 once per row by :func:`decode_fp8_rows` (the tile kernel
  would otherwise decode each row once per output tile across N); the kernel takes bf16
  activations straight into its bf16 ring by TMA;
- the decoder warpgroup(s) stream raw weight tiles by TMA into a ``raw_stages`` ring (the scales
  in boxes of 16 bytes, i.e. 512 values of K, in a two-slot ring of their own), decode them into
  the bf16 ring with the device functions of :data:`PRELUDE` (bit placement and one exact bf16
  multiply per pair of values; a k-block holding a scale byte past :data:`NARROW_SCALE` takes the
  two-multiply form, a branch taken once per k-block so that each path is straight-line code), and
  hand each stage to the consumers on an mbarrier that also counts the activations' TMA; each
  thread loads its raw units of the next k-block into registers while it works on this one, so
  that the loads' latency overlaps other work (``prefetch``);
- two consumer warpgroups run the wgmmas as
  :func:`~deepinfer_backends.sm100.kernels.grouped_gemm_ws.grouped_gemm_bf16_ws` does (one k-block
  in flight, a segment's short last tile computed by one warpgroup).

Faster than the portable kernel, which decodes in the warps that issue the wgmma, but still bound by
the decode (``experiments/results/grouped_gemm_kernels_h200.txt``,
``experiments/results/sm100_design_measurements_h200.md``). Hopper only (wgmma, TMA,
``setmaxnreg``); ``k`` a multiple of 512 (the scale rows are then 16-byte aligned for TMA)."""
import tilelang
import tilelang.language as T

from deepinfer_backends.sm100.kernels import key_decode
from deepinfer_backends.sm100.kernels.grouped_gemm_quant import BLOCK, W_FORMATS, _STORAGE
from deepinfer_backends.sm100.kernels.grouped_gemm_ws import CONSUMERS, consume

_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # every barrier is placed by hand
}
BLOCK_K = 64
SCALE_BOX = 16
"""Scale bytes per row in one TMA box (16 bytes is TMA's narrowest): 512 values of K, 8 k-blocks."""
DECODER_BAR = 1  # named barrier of the decoder warpgroups (0 is __syncthreads)

PRELUDE = key_decode.PRELUDE + r"""
// Sixteen e4m3 values with UE8M0 scale byte `sc` -> two 8-value bf16 chunks. WIDE = false: times
// 2^(sc-7) in one exact multiply, for sc <= 134 (a normal bf16); true: times 2^120, then 2^(sc-127),
// for any sc (the bf16 2^-127 of sc = 0 is subnormal, still exact).
template <bool WIDE>
__device__ __forceinline__ void gq_fp8x16(const void* src, int sc, void* dst0, void* dst1) {
  uint4 v = *reinterpret_cast<const uint4*>(src);
  unsigned w[4] = {v.x, v.y, v.z, v.w}, o[8];
  unsigned f = WIDE ? (sc ? dk_pow2(sc) : 0x00400040u) : dk_pow2(sc + 120);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    o[i] = dk_e4m3x2(w[i / 2], i % 2 ? 0xB3A2u : 0x9180u);
    if (WIDE) o[i] = dk_mul_bf16x2(o[i], 0x7B807B80u);
    o[i] = dk_mul_bf16x2(o[i], f);
  }
  *reinterpret_cast<uint4*>(dst0) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(dst1) = make_uint4(o[4], o[5], o[6], o[7]);
}

// Thirty-two e2m1 values (16 bytes) with UE8M0 scale byte `sc` -> four 8-value bf16 chunks. WIDE =
// false: times 2^(sc-1) in one exact multiply, for sc <= 128; true: times 2^126, then 2^(sc-127).
template <bool WIDE>
__device__ __forceinline__ void gq_fp4x32(const void* src, int sc, void* dst0, void* dst1, void* dst2,
                                          void* dst3) {
  uint4 v = *reinterpret_cast<const uint4*>(src);
  unsigned w[4] = {v.x, v.y, v.z, v.w}, o[16];
  unsigned f = WIDE ? (sc ? dk_pow2(sc) : 0x00400040u) : dk_pow2(sc + 126);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    o[i] = dk_e2m1x2(dk_prmt(w[i / 4], 0x4440u + i % 4));  // byte i % 4 alone
    if (WIDE) o[i] = dk_mul_bf16x2(o[i], 0x7E807E80u);
    o[i] = dk_mul_bf16x2(o[i], f);
  }
  *reinterpret_cast<uint4*>(dst0) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(dst1) = make_uint4(o[4], o[5], o[6], o[7]);
  *reinterpret_cast<uint4*>(dst2) = make_uint4(o[8], o[9], o[10], o[11]);
  *reinterpret_cast<uint4*>(dst3) = make_uint4(o[12], o[13], o[14], o[15]);
}
"""
"""CUDA device functions ``gq_fp8x16<WIDE>`` and ``gq_fp4x32<WIDE>`` (beside the ``key_decode``
functions whose bf16x2 multiply, e4m3 and e2m1 bit placement and powers of two they use): 16 raw
bytes and a scale byte in, 16-byte bf16 chunks out (each chunk one swizzle unit of a wgmma operand,
so each takes its own address). The one-multiply form (``WIDE = false``) holds for scale bytes up
to :data:`NARROW_SCALE`."""
NARROW_SCALE = {"fp8": 134, "mxfp4": 128}
"""Largest UE8M0 byte for which ``2^(byte - 127)`` times the decode's bit-placement offset (2^120
for e4m3, 2^126 for e2m1) is a normal bf16."""


SHARED_BYTES = 227 * 1024  # an H100 / H200 CTA's dynamic shared memory


def max_raw_stages(block_m: int, block_n: int, num_stages: int, w_format: str) -> int:
    """The deepest raw ring (at most 8) that fits shared memory beside ``num_stages`` bf16 stages
    and the scale ring (1 KB kept spare)."""
    bf16_stage = (block_m + block_n) * BLOCK_K * 2
    raw_stage = block_n * BLOCK_K // (2 if w_format == "mxfp4" else 1)
    return max(1, min(8, (SHARED_BYTES - 1024 - num_stages * bf16_stage - 2 * block_n * SCALE_BOX) // raw_stage))


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_quant_ws(experts: int, n: int, k: int, w_format: str, block_m: int = 128, block_n: int = 256,
                          num_stages: int = 3, raw_stages: int | None = None, decoders: int = 1,
                          registers: tuple | None = None, swizzle: int = 8, prefetch: str = "after"):
    """Kernel ``(x bf16 [m, k], w [experts, n, k or k/2], w_scale uint8 [experts, n, k/32],
    tile_expert, tile_row, tile_end [tiles], y float32 [m, n])``: the weights as
    :func:`~deepinfer_backends.sm100.kernels.grouped_gemm_quant.grouped_gemm_quant` takes them, the
    activations in bf16 (FP8 ones go through :func:`decode_fp8_rows` first). ``block_m`` 128 (a
    consumer warpgroup per 64 rows) or 64 (the two split the columns); ``decoders`` warpgroups
    decode; ``raw_stages`` defaults to as many as fit; ``registers`` is the (consumer, decoder)
    budget per thread, multiples of 8 (default (200, 104) with one decoder warpgroup, (160, 96) with
    two). Each decoder thread holds its raw units of two k-blocks in registers: ``prefetch``
    ``"after"`` loads the next k-block's once this one is decoded (its loads then overlap the
    hand-off), ``"before"`` ahead of the decode (faster with two decoder warpgroups; with one, its
    wait for the next raw tile delays the decode)."""
    if w_format not in W_FORMATS:
        raise ValueError(f"w_format={w_format!r}; expected one of {W_FORMATS}")
    if k % (SCALE_BOX * BLOCK):
        raise ValueError(f"k={k} must be a multiple of {SCALE_BOX * BLOCK}")
    raw_stages = raw_stages or max_raw_stages(block_m, block_n, num_stages, w_format)
    if block_m not in (64, 128) or block_n % 64 or decoders not in (1, 2) or not 2 <= raw_stages <= 8 \
            or num_stages < 2 or prefetch not in ("before", "after"):
        raise ValueError(f"block_m={block_m} must be 64 or 128, block_n={block_n} a multiple of 64, decoders={decoders}"
                         f" 1 or 2, raw_stages={raw_stages} in [2, 8] (the next k-block's raw tile is read while "
                         f"this one is decoded; fewer bf16 stages leave room), num_stages={num_stages} at least 2, "
                         f"prefetch={prefetch!r} 'before' or 'after'")
    units = BLOCK_K // (2 if w_format == "mxfp4" else 1) // 16  # 16-byte raw units in a row of a k-block
    if block_n * units % (128 * decoders) or (decoders == 2 and block_m * block_n > 64 * 256):
        raise ValueError(f"decoders={decoders} with {block_m} x {block_n} tiles: the decoders must share the "
                         f"{block_n * units} raw units of a k-block evenly, and two decoder warpgroups leave 128 "
                         f"registers a thread, too few for accumulators past 64 x 256 (ptxas needs 154)")
    threads = CONSUMERS + 128 * decoders
    launch = 65536 // threads // 8 * 8  # registers a thread gets at launch (168 for 384 threads, 128 for 512)
    registers = registers or ((200, 104) if decoders == 1 else (160, 96))
    if any(r % 8 or not 24 <= r <= 256 for r in registers) or \
            registers[0] * CONSUMERS + registers[1] * 128 * decoders > launch * threads:
        raise ValueError(f"registers={registers}: multiples of 8 in [24, 256] whose sum over the {threads} threads "
                         f"is at most the {launch * threads} of launch (setmaxnreg.inc would wait forever)")
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    mxfp4 = w_format == "mxfp4"
    per_byte = 2 if mxfp4 else 1
    k_blocks, box_blocks = k // BLOCK_K, SCALE_BOX * BLOCK // BLOCK_K
    dec_threads = 128 * decoders
    iters = block_n * units // dec_threads

    def row_and_unit(i, d):
        """Weight row and 16-byte raw unit of it that decoder thread ``d`` takes in its call ``i``."""
        return (i * dec_threads + d) // units, (i * dec_threads + d) % units

    @T.macro
    def issue_raw(w, w_scale, w_raw, w_scale_s, raw_full, expert, bn, kb, slot):
        """TMA of k-block ``kb``'s raw weight tile into raw slot ``slot`` (with its scale box first
        when ``kb`` opens one)."""
        box = kb // box_blocks
        if kb % box_blocks == 0:
            T.tma_copy(w_scale[expert, bn * block_n:(bn + 1) * block_n, box * SCALE_BOX:(box + 1) * SCALE_BOX],
                       w_scale_s[box % 2, :, :], barrier=raw_full[slot])
        T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * BLOCK_K // per_byte:(kb + 1) * BLOCK_K // per_byte],
                   w_raw[slot, :, :], barrier=raw_full[slot], annotations={"emit_arrive": 1})

    @T.macro
    def issue_x(x, x_s, ready, row0, kb):
        """TMA of k-block ``kb``'s bf16 activations straight into bf16 stage ``kb % num_stages`` (one
        arrival of that stage's ``ready``)."""
        T.tma_copy(x[row0:row0 + block_m, kb * BLOCK_K:(kb + 1) * BLOCK_K], x_s[kb % num_stages, :, :],
                   barrier=ready[kb % num_stages], annotations={"emit_arrive": 1})

    @T.macro
    def decode(w_in, w_sc, w_s, stage, d, wide: bool):
        for i in T.unroll(iters):
            r, c = row_and_unit(i, d)
            if mxfp4:
                T.call_extern("handle", f"gq_fp4x32<{str(wide).lower()}>", T.access_ptr(w_in[i, 0], "r"), w_sc[i],
                              *[T.access_ptr(w_s[stage, r, c * 32 + q * 8], "w") for q in range(4)])
            else:
                T.call_extern("handle", f"gq_fp8x16<{str(wide).lower()}>", T.access_ptr(w_in[i, 0], "r"), w_sc[i],
                              *[T.access_ptr(w_s[stage, r, c * 16 + q * 8], "w") for q in range(2)])

    @T.macro
    def load_raw(w_raw, w_scale_s, raw_full, w_in, w_sc, wide, kb, d):
        """This thread's raw units of k-block ``kb`` and their scale bytes into registers, once the
        TMA has landed; ``wide`` says whether a scale byte needs the two-multiply decode."""
        slot, box, byte0 = kb % raw_stages, (kb // box_blocks) % 2, (kb % box_blocks) * (BLOCK_K // BLOCK)
        T.barrier_wait(raw_full[slot], (kb // raw_stages) & 1)
        wide[0] = 0
        for i in T.unroll(iters):
            r, c = row_and_unit(i, d)
            for v in T.vectorized(16):
                w_in[i, v] = w_raw[slot, r, c * 16 + v]
            w_sc[i] = T.cast(w_scale_s[box, r, byte0 + (c if mxfp4 else c // 2)], "int32")
            wide[0] = wide[0] | T.if_then_else(w_sc[i] > NARROW_SCALE[w_format], 1, 0)

    @T.macro
    def step(x, w, w_scale, x_s, w_s, w_raw, w_scale_s, raw_full, ready, free, expert, bn, row0, d, kb,
             w_in, w_sc, wide, next_in, next_sc, next_wide):
        """The decoders' k-block ``kb`` (its raw units already in ``w_in``): decode it into its bf16
        stage and load k-block ``kb + 1``'s units into ``next_*`` (before or after, ``prefetch``),
        hand the stage over, refill the raw slot."""
        stage = kb % num_stages
        if prefetch == "before" and kb + 1 < k_blocks:
            load_raw(w_raw, w_scale_s, raw_full, next_in, next_sc, next_wide, kb + 1, d)
        T.barrier_wait(free[stage], ((kb // num_stages) & 1) ^ 1)
        if wide[0] != 0:  # one branch a k-block: each path is straight-line code
            decode(w_in, w_sc, w_s, stage, d, True)
        else:
            decode(w_in, w_sc, w_s, stage, d, False)
        if prefetch == "after" and kb + 1 < k_blocks:
            load_raw(w_raw, w_scale_s, raw_full, next_in, next_sc, next_wide, kb + 1, d)
        T.fence_proxy_async()  # the generic-proxy stores must be visible to wgmma
        T.barrier_arrive(ready[stage])
        # Every thread has read raw slot kb (one step earlier), so the TMA may overwrite it. Issued before
        # this barrier, the TMA could land before every thread had read the slot.
        T.sync_threads(DECODER_BAR, dec_threads)
        if d < 128:
            if kb + raw_stages < k_blocks:
                issue_raw(w, w_scale, w_raw, w_scale_s, raw_full, expert, bn, kb + raw_stages, kb % raw_stages)
            if kb + 1 < k_blocks:  # the next stage's activations, once the consumers free it
                T.barrier_wait(free[(kb + 1) % num_stages], (((kb + 1) // num_stages) & 1) ^ 1)
                issue_x(x, x_s, ready, row0, kb + 1)

    @T.prim_func
    def kernel(x: T.Tensor((m, k), "bfloat16"), w: T.Tensor((experts, n, k // per_byte), _STORAGE[w_format]),
               w_scale: T.Tensor((experts, n, k // BLOCK), "uint8"), tile_expert: T.Tensor((tiles,), "int32"),
               tile_row: T.Tensor((tiles,), "int32"), tile_end: T.Tensor((tiles,), "int32"),
               y: T.Tensor((m, n), "float")):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=threads, prelude=PRELUDE) as (bn, bt):
            x_s = T.alloc_shared((num_stages, block_m, BLOCK_K), "bfloat16")
            w_s = T.alloc_shared((num_stages, block_n, BLOCK_K), "bfloat16")
            w_raw = T.alloc_shared((raw_stages, block_n, BLOCK_K // per_byte), _STORAGE[w_format])
            w_scale_s = T.alloc_shared((2, block_n, SCALE_BOX), "uint8")
            acc = T.alloc_fragment((block_m, block_n), "float")
            raw_full = T.alloc_barrier([1] * raw_stages)
            ready = T.alloc_barrier([dec_threads + 1] * num_stages)  # the decoders and the activations' TMA
            free = T.alloc_barrier([CONSUMERS] * num_stages)
            live = T.alloc_local((1,), "int32")
            # this thread's raw units of two k-blocks (the one decoded, the next one loaded meanwhile)
            w_in0 = T.alloc_local((iters, 16), _STORAGE[w_format])
            w_in1 = T.alloc_local((iters, 16), _STORAGE[w_format])
            w_sc0, w_sc1 = T.alloc_local((iters,), "int32"), T.alloc_local((iters,), "int32")
            wide0, wide1 = T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32")
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)  # as grouped_gemm_bf16: readers of one weight tile run together
            expert, row0 = tile_expert[bt], tile_row[bt]
            if expert < experts:
                if tx >= CONSUMERS:  # decoders
                    T.set_max_nreg(registers[1], int(registers[1] >= launch))
                    d = tx - CONSUMERS
                    if d < 128:
                        for j in T.unroll(raw_stages):
                            if j < k_blocks:
                                issue_raw(w, w_scale, w_raw, w_scale_s, raw_full, expert, bn, j, j)
                        issue_x(x, x_s, ready, row0, 0)
                    load_raw(w_raw, w_scale_s, raw_full, w_in0, w_sc0, wide0, 0, d)
                    for kb2 in T.serial(k_blocks // 2):  # k_blocks is even; two steps swap the buffers
                        step(x, w, w_scale, x_s, w_s, w_raw, w_scale_s, raw_full, ready, free, expert, bn, row0, d,
                             kb2 * 2, w_in0, w_sc0, wide0, w_in1, w_sc1, wide1)
                        step(x, w, w_scale, x_s, w_s, w_raw, w_scale_s, raw_full, ready, free, expert, bn, row0, d,
                             kb2 * 2 + 1, w_in1, w_sc1, wide1, w_in0, w_sc0, wide0)
                else:
                    T.set_max_nreg(registers[0], int(registers[0] >= launch))
                    consume(x_s, w_s, acc, ready, free, live, tx, k_blocks, num_stages, block_m, tile_end[bt] - row0)
                    for i, j in T.Parallel(block_m, block_n):
                        if i < tile_end[bt] - row0:
                            y[row0 + i, bn * block_n + j] = acc[i, j]

    return kernel


@tilelang.jit
def decode_fp8_rows(k: int, threads: int = 128):
    """Kernel ``(x e4m3 [m, k], x_scale uint8 [m, k/32], out bf16 [m, k])``: FP8 activations decoded
    exactly to bf16 once, for :func:`grouped_gemm_quant_ws` (one CTA per row, 16 values a call)."""
    if k % (16 * threads):
        raise ValueError(f"k={k} must be a multiple of {16 * threads}")
    m = T.dynamic("m")

    @T.prim_func
    def kernel(x: T.Tensor((m, k), "float8_e4m3fn"), x_scale: T.Tensor((m, k // BLOCK), "uint8"),
               out: T.Tensor((m, k), "bfloat16")):
        with T.Kernel(m, threads=threads, prelude=PRELUDE) as row:
            for j in T.unroll(k // 16 // threads):
                c = j * threads + T.get_thread_binding()
                T.call_extern("handle", "gq_fp8x16<true>", T.access_ptr(x[row, c * 16], "r"),
                              T.cast(x_scale[row, c // 2], "int32"), T.access_ptr(out[row, c * 16], "w"),
                              T.access_ptr(out[row, c * 16 + 8], "w"))

    return kernel


def main() -> None:
    """Check the warp-specialised block-scaled grouped GEMM (its cases with many rows reach it) against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("grouped_gemm", "linear")


if __name__ == "__main__":
    main()

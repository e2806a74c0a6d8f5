"""Decoding quantized key rows to bf16 in shared memory, eight values per call, as CUDA device
functions the warp-specialised sparse MLA kernel takes through ``T.Kernel(..., prelude=PRELUDE)``.

The rows are those of the reference document §1.5 / §6.1 (``deepinfer.hal.formats``):

- ``fp8`` (528 B): 512 e4m3 values, then 16 UE8M0 scales, one per 32 values (byte ``b`` is
  ``2^(b-127)``: the float whose bits are ``b << 23``, or the subnormal ``2^-127`` for ``b = 0``);
- ``fp4`` (288 B): 256 B of e2m1 pairs (low nibble first), then 32 e4m3 scales, one per 16.

Each function reads eight values (8 B of e4m3 or 4 B of e2m1) and their scale byte, and writes
eight bf16 (16 B, one swizzle chunk of a wgmma operand) with one vector store. The results are
bit-identical to the reference decode (float32 products rounded once to bf16), by bit placement and
exact bf16 multiplies only, with no float conversion instruction (those go through the SM's
quarter-rate conversion unit): an e4m3 code ``s eeee mmm`` becomes the bf16 with those bits at 15
and 10..4 (the value times ``2^-120``) and an e2m1 code ``s eem`` the bf16 with them at 15 and 8..6
(times ``2^-126``, subnormal for 0 and 0.5); two bf16 products a pair then scale them, split so
that only the first can round (a subnormal result of a tiny UE8M0 scale). The e4m3 NaN codes
(``0x7F`` / ``0xFF``, as values or as fp4 scales) decode to finite values: the encoders saturate
and never write them."""
import tilelang
import tilelang.language as T

from deepinfer.hal.formats import token_format

PRELUDE = r"""
__device__ __forceinline__ unsigned dk_mul_bf16x2(unsigned a, unsigned b) {
  unsigned out;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}

__device__ __forceinline__ unsigned dk_prmt(unsigned word, unsigned sel) {
  unsigned out;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(out) : "r"(word), "r"(sel));
  return out;
}

__device__ __forceinline__ unsigned dk_prmt2(unsigned lo, unsigned hi, unsigned sel) {
  unsigned out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(lo), "r"(hi), "r"(sel));
  return out;
}

// bf16x2 of the two e4m3 bytes picked by `sel` (0x9180: bytes 0, 1; 0xB3A2: bytes 2, 3), times 2^-120:
// each byte beside its sign replicated, then s eeee mmm shifted to bf16 bits 15 and 10..4.
__device__ __forceinline__ unsigned dk_e4m3x2(unsigned word, unsigned sel) {
  return (dk_prmt(word, sel) << 4) & 0x87F087F0u;
}

__device__ __forceinline__ unsigned dk_pow2(unsigned exponent_field) {  // bf16x2 2^(field - 127), twice
  return (exponent_field << 7) * 0x10001u;
}

// bf16x2 of the byte's two e2m1 codes (low nibble first) times 2^-126: s eem to bits 15 and 8..6.
__device__ __forceinline__ unsigned dk_e2m1x2(unsigned byte) {
  unsigned t = byte * 0x1001u;  // the byte at bit 0 and again at bit 12: both nibbles land by one shift
  return ((t << 6) & 0x01C001C0u) | ((t << 12) & 0x80008000u);
}

// Eight e4m3 values times 2^(sc - 127) (sc = 0: 2^-127) as two exact bf16x2 multiplies a pair, split
// so that the first is the only one that rounds: by 2^(min(sc, 127) - 7), then by 2^(max(sc, 127) - 127).
__device__ __forceinline__ void dk_fp8x8(const void* src, int sc, void* dst) {
  uint2 v = *reinterpret_cast<const uint2*>(src);
  unsigned low = dk_pow2(min(sc, 127) + 120), high = dk_pow2(max(sc, 127));
  uint4 o;
  o.x = dk_mul_bf16x2(dk_mul_bf16x2(dk_e4m3x2(v.x, 0x9180u), low), high);
  o.y = dk_mul_bf16x2(dk_mul_bf16x2(dk_e4m3x2(v.x, 0xB3A2u), low), high);
  o.z = dk_mul_bf16x2(dk_mul_bf16x2(dk_e4m3x2(v.y, 0x9180u), low), high);
  o.w = dk_mul_bf16x2(dk_mul_bf16x2(dk_e4m3x2(v.y, 0xB3A2u), low), high);
  *reinterpret_cast<uint4*>(dst) = o;
}

// Byte j's two e2m1 codes times the scale pair `scale2`, from `lo` / `hi`, the word's low / high nibbles
// each moved to the top of a byte of its own: beside its sign replicated (prmt), a nibble shifts to bf16
// bits 15 and 8..6 (times 2^-126); then two exact multiplies, by 2^126 and by the scale.
__device__ __forceinline__ unsigned dk_e2m1x2_scaled(unsigned lo, unsigned hi, unsigned j, unsigned scale2) {
  unsigned sel = j | (8u | j) << 4 | (4u + j) << 8 | (12u + j) << 12;  // lo byte j, its sign, hi byte j, its sign
  return dk_mul_bf16x2(dk_mul_bf16x2((dk_prmt2(lo, hi, sel) << 2) & 0x81C081C0u, 0x7E807E80u), scale2);
}

// Eight e2m1 values (4 bytes, low nibble first) times the e4m3 scale `sb` (its byte placed as an e4m3
// value, times 2^120).
__device__ __forceinline__ void dk_fp4x8(const void* src, int sb, void* dst) {
  unsigned x = *reinterpret_cast<const unsigned*>(src);
  unsigned scale2 = dk_mul_bf16x2(dk_e4m3x2(sb, 0x8080u), 0x7B807B80u);
  unsigned lo = (x << 4) & 0xF0F0F0F0u, hi = x & 0xF0F0F0F0u;
  uint4 o;
  o.x = dk_e2m1x2_scaled(lo, hi, 0, scale2);
  o.y = dk_e2m1x2_scaled(lo, hi, 1, scale2);
  o.z = dk_e2m1x2_scaled(lo, hi, 2, scale2);
  o.w = dk_e2m1x2_scaled(lo, hi, 3, scale2);
  *reinterpret_cast<uint4*>(dst) = o;
}
"""
"""CUDA device functions ``dk_fp8x8`` and ``dk_fp4x8`` ``(src, scale_byte, dst)``, and the pieces
they are made of (bf16x2 multiply, byte permutes, e4m3 and e2m1 bit placement, powers of two), which
the block-scaled GEMM's decoder (``grouped_gemm_quant_ws.PRELUDE``) uses too."""


RAW_LAYOUT = {"fp8": (8, 512, 4), "fp4": (4, 256, 2)}
"""Per format: raw bytes of one call's eight values, offset of the scale bytes in the row, and calls
per scale byte."""


@T.macro
def load_run(raw, slot, i, q, fmt: str, held, scale, n: int):
    """Raw bytes of values ``8q .. 8(q+n)-1`` of ``fmt`` row ``raw[slot, i]`` (8 a call for ``fp8``, 4
    for ``fp4``; ``q`` a multiple of ``n``, so that they load as whole vectors) into ``held`` and
    each call's scale byte into ``scale[c]``: registers, so that a thread's loads for a run of calls
    are all issued before its first decode store, in a few wide loads."""
    per_call, scales, calls_per_scale = RAW_LAYOUT[fmt]
    for v in T.vectorized(n * per_call):
        held[v] = raw[slot, i, q * per_call + v]
    for c in T.unroll(n):
        scale[c] = T.cast(raw[slot, i, scales + (q + c) // calls_per_scale], "int32")


@T.macro
def store8(held, scale, c, fmt: str, k_s, stage, i, q):
    """Values ``8q .. 8q+7``, call ``c`` of a run :func:`load_run` holds -> ``k_s[stage, i, 8q:8q+8]``."""
    T.call_extern("handle", f"dk_{fmt}x8", T.access_ptr(held[c * RAW_LAYOUT[fmt][0]], "r"), scale[c],
                  T.access_ptr(k_s[stage, i, q * 8], "w"))


@tilelang.jit
def decode_rows(fmt: str):
    """Kernel ``(rows uint8 [n, bytes_per_token], out bf16 [n, 512])``: every row decoded by the
    functions above, straight from global memory (a check on them, and a debugging aid)."""
    n = T.dynamic("n")

    @T.prim_func
    def kernel(rows: T.Tensor((n, token_format(fmt).bytes_per_token), "uint8"), out: T.Tensor((n, 512), "bfloat16")):
        with T.Kernel(n, threads=64, prelude=PRELUDE) as row:
            q = T.get_thread_binding()
            per_call, scales, calls_per_scale = RAW_LAYOUT[fmt]
            T.call_extern("handle", f"dk_{fmt}x8", T.access_ptr(rows[row, q * per_call], "r"),
                          T.cast(rows[row, scales + q // calls_per_scale], "int32"), T.access_ptr(out[row, q * 8], "w"))

    return kernel


def main() -> None:
    """Check the key decode, through the sparse MLA kernels that use it against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("mla_sparse_decode")


if __name__ == "__main__":
    main()

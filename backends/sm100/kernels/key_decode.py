"""Decoding quantized key rows to bf16 in shared memory, eight values per call, as CUDA device
functions the warp-specialised sparse MLA kernel takes through ``T.Kernel(..., prelude=PRELUDE)``.

The rows are those of the reference document §1.5 / §6.1 (``deepinfer.hal.formats``):

- ``fp8`` (528 B): 512 e4m3 values, then 16 UE8M0 scales, one per 32 values (byte ``b`` is
  ``2^(b-127)``: the float whose bits are ``b << 23``, or the subnormal ``2^-127`` for ``b = 0``);
- ``fp4`` (288 B): 256 B of e2m1 pairs (low nibble first), then 32 e4m3 scales, one per 16.

Each function reads eight values (8 B of e4m3 or 4 B of e2m1) and their scale byte, and writes
eight bf16 (16 B, one swizzle chunk of a wgmma operand) with one vector store. The results are
bit-identical to the reference decode: fp8 is converted exactly (``cvt.rn.f16x2.e4m3x2``), scaled
in float32 without flushing subnormals and rounded once to bf16; an e2m1 code ``s eee`` becomes
the bf16 with those bits at 15 and 8..6 (the value times ``2^-126``, subnormal for 0 and 0.5),
which two exact bf16 products scale by ``2^126`` and by the e4m3 scale (2 x 4 significant bits
fit bf16's 8). Both replace per-element float conversions and a 16-entry table."""
import tilelang
import tilelang.language as T

from deepinfer.hal.formats import token_format

PRELUDE = r"""
__device__ __forceinline__ unsigned dk_pack_bf16x2(float lo, float hi) {
  unsigned out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

__device__ __forceinline__ unsigned dk_e4m3x2_scaled(unsigned pair, float scale) {
  unsigned h2;
  asm("{\n .reg .b16 p;\n cvt.u16.u32 p, %1;\n cvt.rn.f16x2.e4m3x2 %0, p;\n}" : "=r"(h2) : "r"(pair));
  unsigned short lo = h2 & 0xFFFFu, hi = h2 >> 16;
  float flo, fhi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(flo) : "h"(lo));
  asm("cvt.f32.f16 %0, %1;" : "=f"(fhi) : "h"(hi));
  return dk_pack_bf16x2(flo * scale, fhi * scale);
}

__device__ __forceinline__ void dk_fp8x8(const void* src, int scale_byte, void* dst) {
  uint2 v = *reinterpret_cast<const uint2*>(src);
  float scale = __int_as_float(scale_byte ? scale_byte << 23 : 0x00400000);  // byte 0: 2^-127, subnormal
  uint4 o;
  o.x = dk_e4m3x2_scaled(v.x & 0xFFFFu, scale);
  o.y = dk_e4m3x2_scaled(v.x >> 16, scale);
  o.z = dk_e4m3x2_scaled(v.y & 0xFFFFu, scale);
  o.w = dk_e4m3x2_scaled(v.y >> 16, scale);
  *reinterpret_cast<uint4*>(dst) = o;
}

__device__ __forceinline__ unsigned dk_mul_bf16x2(unsigned a, unsigned b) {
  unsigned out;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}

// bf16x2 of the byte's two e2m1 codes (low nibble first) times 2^-126: s eem to bits 15 and 8..6.
__device__ __forceinline__ unsigned dk_e2m1x2(unsigned byte) {
  unsigned t = byte * 0x1001u;  // the byte at bit 0 and again at bit 12: both nibbles land by one shift
  return ((t << 6) & 0x01C001C0u) | ((t << 12) & 0x80008000u);
}

__device__ __forceinline__ unsigned dk_e2m1x2_scaled(unsigned byte, unsigned scale2) {
  return dk_mul_bf16x2(dk_mul_bf16x2(dk_e2m1x2(byte), 0x7E807E80u), scale2);  // x 2^126, x scale
}

__device__ __forceinline__ void dk_fp4x8(const void* src, int scale_byte, void* dst) {
  unsigned x = *reinterpret_cast<const unsigned*>(src);
  unsigned scale2 = dk_e4m3x2_scaled(scale_byte | (scale_byte << 8), 1.0f);
  uint4 o;
  o.x = dk_e2m1x2_scaled(x & 0xFFu, scale2);
  o.y = dk_e2m1x2_scaled((x >> 8) & 0xFFu, scale2);
  o.z = dk_e2m1x2_scaled((x >> 16) & 0xFFu, scale2);
  o.w = dk_e2m1x2_scaled(x >> 24, scale2);
  *reinterpret_cast<uint4*>(dst) = o;
}
"""
"""CUDA device functions ``dk_fp8x8`` and ``dk_fp4x8`` ``(src, scale_byte, dst)``."""


@T.macro
def load8(raw, slot, i, q, fmt: str, held, scale, c):
    """Raw bytes of values ``8q .. 8q+7`` of ``fmt`` row ``raw[slot, i]`` (8 for ``fp8``, 4 for
    ``fp4``) into ``held[c]`` and their scale byte into ``scale[c]``: registers, so that a thread's
    loads for a whole block can be issued before its first decode stores."""
    if fmt == "fp8":
        for v in T.vectorized(8):
            held[c, v] = raw[slot, i, q * 8 + v]
        scale[c] = T.cast(raw[slot, i, 512 + q // 4], "int32")
    else:
        for v in T.vectorized(4):
            held[c, v] = raw[slot, i, q * 4 + v]
        scale[c] = T.cast(raw[slot, i, 256 + q // 2], "int32")


@T.macro
def store8(held, scale, c, fmt: str, k_s, stage, i, q):
    """Values ``8q .. 8q+7`` held by :func:`load8` in ``held[c]`` / ``scale[c]`` -> ``k_s[stage, i, 8q:8q+8]``."""
    T.call_extern("handle", f"dk_{fmt}x8", T.access_ptr(held[c, 0], "r"), scale[c],
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
            if fmt == "fp8":
                T.call_extern("handle", "dk_fp8x8", T.access_ptr(rows[row, q * 8], "r"),
                              T.cast(rows[row, 512 + q // 4], "int32"), T.access_ptr(out[row, q * 8], "w"))
            else:
                T.call_extern("handle", "dk_fp4x8", T.access_ptr(rows[row, q * 4], "r"),
                              T.cast(rows[row, 256 + q // 2], "int32"), T.access_ptr(out[row, q * 8], "w"))

    return kernel

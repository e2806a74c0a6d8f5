"""Block-scaled grouped GEMM for few rows per expert (MoE decode): FP8 or MXFP4 expert weights
decoded in registers, straight into ``mma.sync`` operands, with the output transposed.

Same contract as :func:`~deepinfer_backends.sm100.kernels.grouped_gemm_quant.grouped_gemm_quant`
(contiguous expert segments, UE8M0 scales per 32 along K, exact decode to bf16, float32 result),
for the shapes where the tile kernels waste their work: a decode step gives each expert a handful
of rows, and a 64-row tile then runs the tensor cores 94 % idle while every weight value still has
to be decoded once per tile. Here the weights are the ``M`` side of the MMA and the rows the ``N``
side (``y^T = w x^T``), so the tensor-core work follows the real rows (``block_t`` a tile, a
multiple of 8), and what sets the pace is reading and decoding each weight byte once, as a
bandwidth-bound kernel should.

Each warp owns 16 weight rows (output columns; ``16 * tiles_m`` with ``tiles_m`` MMA tiles) of one
expert and one tile of rows, and walks K in chunks of 128. ``mma.m16n8k16`` gives thread ``(g, t)``
(lane ``4g + t``) the K positions ``2t, 2t+1, 2t+8, 2t+9`` of each 16-wide step, of A (weight rows
``g`` and ``g + 8``) and of B (row ``g`` of the tile) alike. Any bijection between those positions and
K serves, as long as A and B use the same: thread ``t`` takes the 32 values ``32t .. 32t + 31`` of the
chunk, step ``s`` the four from ``4s``. So each thread's raw weight bytes of a chunk are one
contiguous run with a single scale byte (16 bytes of MXFP4, 32 of FP8), its activations one 64-byte
run of bf16, and the decode feeds the MMA without going through shared memory. Runs of ``depth``
chunks are loaded ahead into registers. The decode is the bit placement and exact bf16 multiplies of
``key_decode`` (one multiply a pair of values when a warp's scale bytes allow it, a warp-uniform
choice per chunk, else two).

FP8 activations are decoded to bf16 once per row first
(:func:`~deepinfer_backends.sm100.kernels.grouped_gemm_quant_ws.decode_fp8_rows`): each tile's
activations are read by every warp of the grid's column, so decoding them here would repeat it
``n / 16`` times. ``mma.sync`` runs on sm_80 and later, Blackwell included.

With few rows per expert it is faster than :mod:`grouped_gemm_quant_ws`. Its limit is the L1's data
pipe, much of whose traffic is the activations each warp reads for its own weight rows; ``tiles_m = 2``
shares one read of them between 32 weight rows (``experiments/results/grouped_gemm_kernels_h200.txt``,
``experiments/results/sm100_design_measurements_h200.md``)."""
import tilelang
import tilelang.language as T

from deepinfer_backends.sm100.kernels import key_decode
from deepinfer_backends.sm100.kernels.grouped_gemm_quant import BLOCK, W_FORMATS, _STORAGE
from deepinfer_backends.sm100.kernels.grouped_gemm_quant_ws import NARROW_SCALE

_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True}  # every index is clamped by hand
CHUNK = 128
"""K values a warp takes per step: 32 per thread, one scale block."""

PRELUDE = key_decode.PRELUDE + r"""
// bf16x2 pair p (values 2p, 2p+1) of a thread's 32-value run, times the scale, from its raw words. MXFP4:
// byte p of the 16-byte run holds the two e2m1 codes, which `lo` / `hi` hold at the top of byte p % 4 of
// word p / 4 (dk_e2m1x2_scaled's placement); FP8: bytes 2p, 2p+1 of the 32-byte run.
template <bool FP4, bool WIDE>
__device__ __forceinline__ unsigned sk_pair(const unsigned* raw, const unsigned* lo, const unsigned* hi, int p,
                                            unsigned f) {
  unsigned v;
  if (FP4) {
    unsigned j = p % 4, sel = j | (8u | j) << 4 | (4u + j) << 8 | (12u + j) << 12;
    v = (dk_prmt2(lo[p / 4], hi[p / 4], sel) << 2) & 0x81C081C0u;
  } else {
    v = dk_e4m3x2(raw[p / 2], p % 2 ? 0xB3A2u : 0x9180u);
  }
  if (WIDE) v = dk_mul_bf16x2(v, FP4 ? 0x7E807E80u : 0x7B807B80u);
  return dk_mul_bf16x2(v, f);
}

// One chunk: 32 values per thread (one scale block) of weight rows g and g+8 (raw runs r0 / r1, scale
// bytes s0 / s1) times the tile's row groups (GROUPS runs of 32 bf16 in x, 16 words apart, one per 8
// rows) into acc[4 * group + i].
template <bool FP4, bool WIDE, int GROUPS>
__device__ __forceinline__ void sk_block(const unsigned* w0, const unsigned* w1, int s0, int s1, const unsigned* xv,
                                         float* acc) {
  unsigned lo0[4], hi0[4], lo1[4], hi1[4];  // MXFP4: each word's low / high nibbles at the top of their bytes
  if (FP4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo0[i] = (w0[i] << 4) & 0xF0F0F0F0u, hi0[i] = w0[i] & 0xF0F0F0F0u;
      lo1[i] = (w1[i] << 4) & 0xF0F0F0F0u, hi1[i] = w1[i] & 0xF0F0F0F0u;
    }
  }
  unsigned f0, f1;
  if (WIDE) {
    f0 = s0 ? dk_pow2(s0) : 0x00400040u;  // 2^-127 is a bf16 subnormal
    f1 = s1 ? dk_pow2(s1) : 0x00400040u;
  } else {
    f0 = dk_pow2(s0 + (FP4 ? 126 : 120));
    f1 = dk_pow2(s1 + (FP4 ? 126 : 120));
  }
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    unsigned a0 = sk_pair<FP4, WIDE>(w0, lo0, hi0, 2 * s, f0), a1 = sk_pair<FP4, WIDE>(w1, lo1, hi1, 2 * s, f1);
    unsigned a2 = sk_pair<FP4, WIDE>(w0, lo0, hi0, 2 * s + 1, f0);
    unsigned a3 = sk_pair<FP4, WIDE>(w1, lo1, hi1, 2 * s + 1, f1);
#pragma unroll
    for (int j = 0; j < GROUPS; ++j) {
      float* c = acc + 4 * j;
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xv[16 * j + 2 * s]), "r"(xv[16 * j + 2 * s + 1]));
    }
  }
}

// A chunk of TILES pairs of weight rows (raw runs ROW words apart in `raw`, scale bytes in `sc`, rows 2i / 2i+1
// the g / g+8 of tile i) against the same activation runs, each tile into its own 4 * GROUPS accumulators; one
// multiply a pair when every scale byte of the warp allows it (a uniform branch), else two
// (grouped_gemm_quant_ws.NARROW_SCALE).
template <bool FP4, int GROUPS, int TILES>
__device__ __forceinline__ void sk_chunk(const void* raw, const int* sc, const void* x, float* acc) {
  const int narrow = FP4 ? NARROW_MXFP4 : NARROW_FP8, row = FP4 ? 4 : 8;  // a row's raw words
  const unsigned* w = reinterpret_cast<const unsigned*>(raw);
  const unsigned* xv = reinterpret_cast<const unsigned*>(x);
  bool wide = false;
#pragma unroll
  for (int r = 0; r < 2 * TILES; ++r) wide |= sc[r] > narrow;
  if (__any_sync(0xffffffffu, wide)) {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
      sk_block<FP4, true, GROUPS>(w + 2 * i * row, w + (2 * i + 1) * row, sc[2 * i], sc[2 * i + 1], xv,
                                  acc + 4 * GROUPS * i);
  } else {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
      sk_block<FP4, false, GROUPS>(w + 2 * i * row, w + (2 * i + 1) * row, sc[2 * i], sc[2 * i + 1], xv,
                                   acc + 4 * GROUPS * i);
  }
}
""".replace("NARROW_MXFP4", str(NARROW_SCALE["mxfp4"])).replace("NARROW_FP8", str(NARROW_SCALE["fp8"]))
"""CUDA device functions: ``sk_chunk<FP4, GROUPS, TILES>`` decodes a thread's ``2 * TILES`` raw weight
runs of a chunk and issues the chunk's ``mma.sync`` against its ``GROUPS`` activation runs."""


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_quant_skinny(experts: int, n: int, k: int, w_format: str, block_t: int = 8, warps: int = 4,
                              depth: int = 2, tiles_m: int = 1):
    """Kernel ``(x bf16 [m, k], w [experts, n, k or k/2], w_scale uint8 [experts, n, k/32],
    tile_expert, tile_row, tile_end [tiles], y float32 [m, n])`` over a tile schedule of
    ``block_t`` rows (``tile_expert[t] >= experts`` marks an unused tile). A CTA is ``warps`` warps,
    each of ``16 * tiles_m`` weight rows (``tiles_m`` MMA tiles sharing its activation runs: fewer
    activation bytes through the L1 per weight byte; the wrapper takes 2, :func:`gemm.skinny_tiles`);
    each thread keeps ``depth`` chunks of raw weights and activations in registers (``k`` a multiple
    of ``128 * depth``)."""
    if w_format not in W_FORMATS:
        raise ValueError(f"w_format={w_format!r}; expected one of {W_FORMATS}")
    if block_t % 8 or not 8 <= block_t <= 64 or warps not in (1, 2, 4, 8) or tiles_m not in (1, 2, 4) \
            or depth < 1 or k % (CHUNK * depth):
        raise ValueError(f"block_t={block_t} must be a multiple of 8 in [8, 64], warps={warps} 1, 2, 4 or 8, "
                         f"tiles_m={tiles_m} 1, 2 or 4, and k={k} a multiple of {CHUNK} * depth={depth}")
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    fp4 = w_format == "mxfp4"
    run = BLOCK // (2 if fp4 else 1)  # raw bytes a thread takes of one weight row per chunk
    groups = block_t // 8
    rows = 2 * tiles_m  # weight rows a thread decodes: g and g + 8 of each MMA tile
    rows_per_cta = 16 * tiles_m * warps
    chunks = k // CHUNK
    per_byte = 2 if fp4 else 1

    @T.macro
    def load(x, w, w_scale, w_in, w_sc, x_in, expert, feature, token, t, slot, c):
        """Chunk ``c``'s raw weight runs, scale bytes and activation runs into register slot ``slot``."""
        for r in T.unroll(rows):
            for v in T.vectorized(run):
                w_in[slot, r, v] = w[expert, feature[r], c * CHUNK // per_byte + t * run + v]
            w_sc[slot, r] = T.cast(w_scale[expert, feature[r], c * (CHUNK // BLOCK) + t], "int32")
        for j in T.unroll(groups):
            for v in T.vectorized(BLOCK):
                x_in[slot, j, v] = x[token[j], c * CHUNK + t * BLOCK + v]

    @T.prim_func
    def kernel(x: T.Tensor((m, k), "bfloat16"), w: T.Tensor((experts, n, k // per_byte), _STORAGE[w_format]),
               w_scale: T.Tensor((experts, n, k // BLOCK), "uint8"), tile_expert: T.Tensor((tiles,), "int32"),
               tile_row: T.Tensor((tiles,), "int32"), tile_end: T.Tensor((tiles,), "int32"),
               y: T.Tensor((m, n), "float")):
        with T.Kernel(T.ceildiv(n, rows_per_cta), tiles, threads=32 * warps,
                      prelude=PRELUDE) as (bn, bt):
            w_in = T.alloc_local((depth, rows, run), _STORAGE[w_format])
            w_sc = T.alloc_local((depth, rows), "int32")
            x_in = T.alloc_local((depth, groups, BLOCK), "bfloat16")
            acc = T.alloc_local((tiles_m * groups * 4,), "float")
            feature = T.alloc_local((rows,), "int32")
            token = T.alloc_local((groups,), "int32")
            tx = T.get_thread_binding()
            lane = tx % 32
            g, t = lane // 4, lane % 4
            expert, row0, end = tile_expert[bt], tile_row[bt], tile_end[bt]

            if expert < experts:
                base = bn * rows_per_cta + (tx // 32) * 16 * tiles_m + g
                for r in T.unroll(rows):  # rows past n read row n - 1 and are not stored
                    feature[r] = T.min(base + 8 * r, n - 1)
                for j in T.unroll(groups):  # rows past the segment read its last row and are not stored
                    token[j] = T.min(row0 + 8 * j + g, end - 1)
                for i in T.unroll(tiles_m * groups * 4):
                    acc[i] = T.float32(0)
                for d in T.unroll(depth):
                    load(x, w, w_scale, w_in, w_sc, x_in, expert, feature, token, t, d, d)
                for c0 in T.serial(chunks // depth):
                    for d in T.unroll(depth):
                        T.call_extern("handle", f"sk_chunk<{str(fp4).lower()}, {groups}, {tiles_m}>",
                                      T.access_ptr(w_in[d, 0, 0], "r"), T.access_ptr(w_sc[d, 0], "r"),
                                      T.access_ptr(x_in[d, 0, 0], "r"), T.access_ptr(acc[0], "rw"))
                        if (c0 + 1) * depth + d < chunks:
                            load(x, w, w_scale, w_in, w_sc, x_in, expert, feature, token, t, d,
                                 (c0 + 1) * depth + d)
                for tile in T.unroll(tiles_m):
                    for j in T.unroll(groups):
                        for i in T.unroll(4):
                            if row0 + 8 * j + 2 * t + i % 2 < end:
                                if base + 16 * tile + 8 * (i // 2) < n:
                                    y[row0 + 8 * j + 2 * t + i % 2, base + 16 * tile + 8 * (i // 2)] = \
                                        acc[(tile * groups + j) * 4 + i]

    return kernel


def main() -> None:
    """Check the block-scaled grouped GEMM for few rows per expert (its cases with few rows reach it) against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("grouped_gemm", "linear")


if __name__ == "__main__":
    main()

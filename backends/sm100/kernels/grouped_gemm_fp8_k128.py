"""Grouped GEMM on Hopper's native FP8 wgmma: e4m3 activations with one scale per row and 128
values of K x e4m3 expert weights with one scale per output column, float32 result. The
``grouped_gemm`` op serves it for FP8 activations with ``backend.options.quant_gemm=native``
(``experiments/results/grouped_gemm_fp8_k128_h100.md``).

``y[seg e] = x[seg e] @ w[e].T`` over the contiguous expert segments of ``grouped_gemm.py`` (same
tile schedule). A 128-deep k-block is four ``k32`` e4m3 wgmmas into a float32 partial that the
k-block's first wgmma clears, then one fused multiply-add per element,
``acc += partial * x_scale[row]`` (DeepGEMM's SM90 recipe promotes every 128 values of K too);
the weights' column scales multiply the tile once, as it is stored. A weight scale per k-block
would double the promotion's float32 work, which is what the tensor cores wait on. The consumers
read the tile's column scales into shared memory before their first k-block, so the store does
not wait on global loads. With ``out_dtype="bfloat16"`` the product is rounded once and the four
lanes of each quad swap their bf16 pairs (:data:`BF16_STORE`), so that each lane stores 16
contiguous bytes and two lanes fill a 32-byte sector: the SM writes half the sectors of the
float32 result (``experiments/results/fp8_grouped_gemm_epilogue.md``).

Warp specialisation with hand-placed barriers: a producer warpgroup streams each k-block's tiles
and the activations' scales by TMA into one ring stage (the scales gathered per tile and K-major,
as :func:`tile_scales` lays them out and the op's aligner writes them, so a stage's 128 of them
are one aligned 512-byte box; a box starting at a segment's first row would be misaligned for
most segments); each of two consumer warpgroups (64 rows of a 128-row tile) issues its wgmmas,
promotes and only then hands the stage back.
``stagger`` holds the second warpgroup back by one k-block at the start, so that one
warpgroup's promotion tends to run while the other's wgmmas keep the tensor cores busy. With
``blocks`` above one a CTA computes that many adjacent column blocks of its row tile in turn, so
that only its first block waits for the ring to fill.

The HAL's block-scaled operands carry UE8M0 scales per 32 along K;
:func:`~deepinfer_backends.sm100.fp8_scales.aligned` moves them to this kernel's granularity. Hopper only (wgmma, TMA,
``setmaxnreg``)."""
import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.fp8_scales import BLOCK_M, GROUP, tile_scales
from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

E4M3 = "float8_e4m3fn"
MODULE = "grouped_gemm_fp8_k128"  # this module, as launch.compiled names kernel modules
_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # every barrier is placed by hand
}
CONSUMERS = 256  # two consumer warpgroups of 64 rows; the producer warpgroup follows them
SHARED_BYTES = 227 * 1024  # an H100 / H200 CTA's dynamic shared memory
OUT_DTYPES = ("float32", "bfloat16")

BF16_STORE = r"""
#include <cuda_bf16.h>
// One consumer thread's wgmma accumulator (chunk c of 8 columns, row half h at acc[4c + 2h] and
// acc[4c + 2h + 1]) times the column scales, rounded to bf16 and stored 8 columns a lane. Per pair
// of chunks the quad's lanes hold a 4 x 4 matrix of bf16 pairs (lane, slot); two xor shuffles
// transpose it, so that lane q holds slot q (row half q & 1, chunk c + q / 2) of all four lanes.
template <int CHUNKS>
__device__ __forceinline__ void deepinfer_store_bf16(const void* acc_, const void* ws_, void* y_, int ld,
                                                     int rows, int cols) {
  static_assert(CHUNKS % 2 == 0, "block_n must be a multiple of 16");
  const float* acc = static_cast<const float*>(acc_);
  const float* ws = static_cast<const float*>(ws_);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(y_);
  const int lane = threadIdx.x & 31, q = lane & 3;
  const int row = ((threadIdx.x >> 5) & 7) * 16 + (lane >> 2);
  const bool b1 = (q & 2) != 0, b0 = (q & 1) != 0;
  #pragma unroll
  for (int c = 0; c < CHUNKS; c += 2) {
    unsigned v[4];
    #pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int cc = c + (s >> 1), h = s & 1;
      const float2 scale = *reinterpret_cast<const float2*>(ws + 8 * cc + 2 * q);
      __nv_bfloat162 pair = __floats2bfloat162_rn(acc[4 * cc + 2 * h] * scale.x, acc[4 * cc + 2 * h + 1] * scale.y);
      v[s] = *reinterpret_cast<unsigned*>(&pair);
    }
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
      const unsigned got = __shfl_xor_sync(0xffffffffu, b1 ? v[t] : v[t + 2], 2);
      if (b1) v[t] = got; else v[t + 2] = got;
    }
    #pragma unroll
    for (int t = 0; t < 4; t += 2) {
      const unsigned got = __shfl_xor_sync(0xffffffffu, b0 ? v[t] : v[t + 1], 1);
      if (b0) v[t] = got; else v[t + 1] = got;
    }
    const int r = row + (q & 1) * 8, col = 8 * (c + (q >> 1));
    if (r < rows && col < cols)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(y + static_cast<long>(r) * ld + col),
                   "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
  }
}
"""
"""CUDA of the bf16 epilogue; it reads the accumulator in the layout of TileLang's ``wgmma_gemm``
fragment for two 64-row consumer warpgroups (the GPU test checks it against the reference)."""


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_fp8_k128(experts: int, n: int, k: int, block_n: int = 208, num_stages: int | None = None,
                          stagger: bool = True, swizzle: int = 8, out_dtype: str = "float32", blocks: int = 1):
    """Kernel ``(x e4m3 [m, k], x_scale float32 [k/128, tiles * 128], w e4m3 [experts, n, k], w_scale
    float32 [experts, n], tile_expert, tile_row, tile_end int32 [tiles], y out_dtype [m, n])``; ``k`` a
    multiple of 128, ``m`` and ``tiles`` dynamic, ``tile_expert[t] >= experts`` an unused tile,
    ``x_scale[:, 128 t + i]`` the scales of tile ``t``'s row ``i`` (:func:`tile_scales`). Rows of a
    tile past its segment are multiplied but never stored; rows past ``m`` are read as zero.
    ``num_stages`` defaults to as many as fit shared memory. ``out_dtype="bfloat16"`` needs ``n`` a
    multiple of 8. ``blocks`` adjacent column blocks a CTA, in turn through one ring: the producer
    loads the next block's first k-blocks while the consumers store the last one."""
    if k <= 0 or k % GROUP or block_n % 16 or blocks < 1:
        raise ValueError(f"k={k} must be a positive multiple of {GROUP}, block_n={block_n} a multiple of 16, "
                         f"blocks={blocks} at least 1")
    if out_dtype not in OUT_DTYPES or (out_dtype == "bfloat16" and n % 8):
        raise ValueError(f"out_dtype={out_dtype!r} must be one of {OUT_DTYPES}; bfloat16 needs n={n} a multiple of 8")
    bf16 = out_dtype == "bfloat16"
    num_stages = num_stages or min(8, (SHARED_BYTES - 1024 - blocks * block_n * 4)
                                   // ((BLOCK_M + block_n) * GROUP + BLOCK_M * 4))
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    groups = k // GROUP

    @T.macro
    def store(acc, ws_s, y, row0, rows, col0, b):
        """Column block ``b`` of the CTA's (from column ``col0``): ``acc`` times its column scales into
        ``y``, rows below ``rows`` and columns below ``n``."""
        if bf16:
            T.call_extern("handle", f"deepinfer_store_bf16<{block_n // 8}>", acc.data,
                          T.access_ptr(ws_s[b * block_n], "r"), T.access_ptr(y[row0, col0 + b * block_n], "w"),
                          n, rows, n - col0 - b * block_n)
        else:
            for i, j in T.Parallel(BLOCK_M, block_n):
                if i < rows and col0 + b * block_n + j < n:
                    y[row0 + i, col0 + b * block_n + j] = acc[i, j] * ws_s[b * block_n + j]

    @T.prim_func
    def kernel(x: T.Tensor((m, k), E4M3), x_scale: T.Tensor((groups, tiles * BLOCK_M), "float"),
               w: T.Tensor((experts, n, k), E4M3), w_scale: T.Tensor((experts, n), "float"),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), out_dtype)):
        with T.Kernel(T.ceildiv(T.ceildiv(n, block_n), blocks), tiles, threads=CONSUMERS + 128,
                      prelude=BF16_STORE if bf16 else None) as (bn, bt):
            x_s = T.alloc_shared((num_stages, BLOCK_M, GROUP), E4M3)
            w_s = T.alloc_shared((num_stages, block_n, GROUP), E4M3)
            xs_s = T.alloc_shared((num_stages, BLOCK_M), "float")
            ws_s = T.alloc_shared((blocks * block_n,), "float")
            part = T.alloc_fragment((BLOCK_M, block_n), "float")
            acc = T.alloc_fragment((BLOCK_M, block_n), "float")
            full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_barrier([CONSUMERS] * num_stages)
            turn = T.alloc_barrier([128])  # the first warpgroup's first k-block is promoted
            live = T.alloc_local((1,), "int32")  # this warpgroup's rows hold some of the tile's rows
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)
            expert, row0, rows = tile_expert[bt], tile_row[bt], tile_end[bt] - tile_row[bt]
            col0 = bn * blocks * block_n
            if expert < experts:
                if tx >= CONSUMERS:  # producer
                    T.set_max_nreg(40, 0)
                    for kb in T.serial(blocks * groups):
                        slot = kb % num_stages
                        kg = kb % groups
                        c0 = col0 + (kb // groups) * block_n
                        T.barrier_wait(empty[slot], ((kb // num_stages) & 1) ^ 1)
                        T.tma_copy(x[row0:row0 + BLOCK_M, kg * GROUP:(kg + 1) * GROUP], x_s[slot, :, :],
                                   barrier=full[slot])
                        T.tma_copy(x_scale[kg, bt * BLOCK_M:(bt + 1) * BLOCK_M], xs_s[slot, :], barrier=full[slot])
                        T.tma_copy(w[expert, c0:c0 + block_n, kg * GROUP:(kg + 1) * GROUP],
                                   w_s[slot, :, :], barrier=full[slot], annotations={"emit_arrive": 1})
                else:  # consumers
                    T.set_max_nreg(232, 1)
                    live[0] = T.if_then_else((tx // 128) * 64 < rows, 1, 0)
                    for j in T.Parallel(blocks * block_n):
                        ws_s[j] = T.if_then_else(col0 + j < n, w_scale[expert, col0 + j], 0)
                    T.sync_threads(1, CONSUMERS)
                    T.clear(acc)
                    if stagger:
                        if tx >= 128:
                            T.barrier_wait(turn[0], 0)
                    for kb in T.serial(blocks * groups):
                        slot = kb % num_stages
                        T.barrier_wait(full[slot], (kb // num_stages) & 1)
                        if live[0]:
                            T.wgmma_gemm(x_s[slot, :, :], w_s[slot, :, :], part, transpose_B=True,
                                         policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                            T.wait_wgmma(0)
                            for i, j in T.Parallel(BLOCK_M, block_n):
                                acc[i, j] += part[i, j] * xs_s[slot, i]
                        if stagger:
                            if kb == 0:
                                if tx < 128:
                                    T.barrier_arrive(turn[0])
                        T.barrier_arrive(empty[slot])
                        if blocks > 1 and kb % groups == groups - 1:
                            store(acc, ws_s, y, row0, rows, col0, kb // groups)
                            T.clear(acc)
                    if blocks == 1:  # after the loop: a store inside it spills the accumulator
                        store(acc, ws_s, y, row0, rows, col0, 0)

    return kernel


def reference(x, x_scale, w, w_scale, group_sizes) -> torch.Tensor:
    """float64 ``y`` of the kernel's operands (``x_scale [m, k/128]``, ``w_scale [experts, n]``), one
    matmul per expert segment, in float32."""
    xs = x.double() * x_scale.double().repeat_interleave(GROUP, dim=-1)
    out, start = torch.zeros(xs.shape[0], w.shape[1], dtype=torch.float32, device=xs.device), 0
    for expert, size in enumerate(group_sizes.tolist()):
        ws = w[expert].double() * w_scale[expert].double()[:, None]
        out[start:start + size] = (xs[start:start + size] @ ws.T).float()
        start += size
    return out


def run(x, x_scale, w, w_scale, group_sizes, **tiles) -> torch.Tensor:
    """Compile (cached by shape and tiles) and launch on ``x``'s device; ``x_scale [m, k/128]``
    (gathered per tile here), ``w_scale [experts, n]``."""
    from deepinfer_backends.sm100.launch import compiled

    schedule = tile_schedule(group_sizes, x.shape[0], BLOCK_M)
    dtype = torch.bfloat16 if tiles.get("out_dtype") == "bfloat16" else torch.float32
    y = torch.empty(x.shape[0], w.shape[1], dtype=dtype, device=x.device)
    if x.shape[0]:
        compiled(MODULE, "grouped_gemm_fp8_k128", *w.shape, **tiles)(x, tile_scales(x_scale, schedule), w, w_scale,
                                                                     *schedule, y)
    return y


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|`` beyond ``got``'s rounding (half a bf16 ulp of ``|want|`` for a
    bf16 result), relative to the largest ``|want|``."""
    rounding = want.abs() * 2.0 ** -8 if got.dtype == torch.bfloat16 else 0.0
    return ((got.float() - want).abs() - rounding).clamp(min=0).max().item() / want.abs().max().item()


CONFIGS = ({"block_n": 208}, {"block_n": 208, "out_dtype": "bfloat16"},
           {"block_n": 208, "out_dtype": "bfloat16", "blocks": 5}, {"block_n": 192},
           {"block_n": 192, "out_dtype": "bfloat16"}, {"block_n": 208, "stagger": False})
"""The tiles :func:`main` sweeps."""
SHAPES = (("16 experts x 512 rows", 16, 512, 4096, 4096), ("48 experts x 256 rows, w2", 48, 256, 4096, 2048),
          ("48 experts x 1024 rows, w2", 48, 1024, 4096, 2048), ("48 experts x 1024 rows", 48, 1024, 4096, 4096),
          ("dense 8192^3", 1, 8192, 8192, 8192))
"""The compute-bound MoE shapes :func:`main` times: (label, experts, rows an expert, n, k)."""


def main() -> None:
    """Check against :func:`reference` (float64, :func:`error`) and time the tiles
    over compute-bound MoE shapes, beside ``torch._scaled_mm`` on 8192^3 (the card's dense FP8 rate).
    The launch (tile schedule and gathered scales included) is timed as the op would make it."""
    from tilelang.profiler import do_bench

    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    dense = 2 * 8192 ** 3 / do_bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)) / 1e9
    print(f"torch._scaled_mm e4m3 8192^3: {dense:.0f} TFLOP/s")
    gen = torch.Generator("cuda").manual_seed(0)
    for label, experts, rows, n, k in SHAPES:
        sizes = torch.full((experts,), rows, dtype=torch.int64, device="cuda")
        x = torch.randn(experts * rows, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(experts, n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        x_scale = torch.exp2(torch.randint(-8, 0, (x.shape[0], k // GROUP), device="cuda", generator=gen).float())
        w_scale = torch.exp2(torch.randint(-8, 0, (experts, n), device="cuda", generator=gen).float())
        want = reference(x, x_scale, w, w_scale, sizes)
        for tiles in CONFIGS:
            try:
                got = run(x, x_scale, w, w_scale, sizes, **tiles)
                err = error(got, want)
                ms = do_bench(lambda: run(x, x_scale, w, w_scale, sizes, **tiles))
            except Exception as exc:  # a tile that does not compile is reported, the sweep goes on
                print(f"{label} {tiles}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rate = 2 * x.shape[0] * n * k / ms / 1e9
            print(f"{label} m={x.shape[0]} n={n} k={k} {tiles}: {ms:.3f} ms {rate:.0f} TFLOP/s "
                  f"{rate / dense:.3f} of _scaled_mm, error {err:.1e} {'PASS' if err < 1e-3 else 'FAIL'}",
                  flush=True)


if __name__ == "__main__":
    main()

"""Grouped GEMM on Hopper's native FP8 wgmma with scales per 128 values of K: e4m3 activations x
e4m3 expert weights, float32 result. Not served: on the compute-bound MoE shapes it runs at about
the rate of the exact decode-to-bf16 kernel (``kernels/grouped_gemm_quant_ws.py``), which keeps the
reference's numbers (``experiments/results/grouped_gemm_fp8_k128_h100.md``).

``y[seg e] = x[seg e] @ w[e].T`` over the contiguous expert segments of ``grouped_gemm.py`` (same
tile schedule). Each operand row carries one float32 scale per 128 values of K (DeepGEMM's SM90
granularity), so a 128-deep k-block is four ``k32`` e4m3 wgmmas into a float32 partial that the
k-block's first wgmma clears, then one promotion per element,
``acc += partial * (x_scale[row] * w_scale[col])``: two float32 instructions per element for every
128 values of K, a quarter of what scales per 32 cost (``grouped_gemm_fp8_wgmma.py``).

The HAL's block-scaled operands carry UE8M0 scales per 32 along K; :func:`aligned` moves them to
this granularity (:func:`align_reference` is the rule). Hopper only (wgmma, TMA, ``setmaxnreg``)."""
import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

GROUP = 128
"""Values of K under one scale, and the kernel's k-block."""
PRODUCER_REGISTERS = 24
"""Registers a thread of the producer warpgroup keeps (``setmaxnreg``); the consumers share the rest."""
E4M3 = "float8_e4m3fn"
MODULE = "experimental.grouped_gemm_fp8_k128"  # this module, as launch.compiled names kernel modules
MXFP4_SHIFT = 6
"""MXFP4's e2m1 values are held as e4m3 times ``2 ** MXFP4_SHIFT`` (6 x 64 = 384 <= 448)."""
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@tilelang.jit
def grouped_gemm_fp8_k128(experts: int, n: int, k: int, block_m: int = 128, block_n: int = 128,
                          num_stages: int = 4, threads: int = 256, swizzle: int = 8):
    """Kernel ``(x e4m3 [m, k], x_scale float32 [m, k/128], w e4m3 [experts, n, k], w_scale float32
    [experts, n, k/128], tile_expert, tile_row, tile_end int32 [tiles], y float32 [m, n])``; ``k`` a
    multiple of 128, ``m`` and ``tiles`` dynamic, ``tile_expert[t] >= experts`` an empty tile. Rows of
    a tile past its segment are multiplied but never stored; rows past ``m`` are read as zero. The
    producer stages each k-block's scales in shared memory beside its tiles; the consumers copy them
    out before the wgmmas, since the stage is handed back to the producer once the wgmmas are done."""
    if k % GROUP:
        raise ValueError(f"k={k} must be a multiple of {GROUP}")
    if block_m != 64 * (threads // 128):
        raise ValueError(f"block_m={block_m} must be 64 rows per consumer warpgroup ({threads} threads)")
    consumer_registers = min(232, (65536 - 128 * PRODUCER_REGISTERS) // threads // 8 * 8)
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    groups = k // GROUP

    @T.prim_func
    def kernel(x: T.Tensor((m, k), E4M3), x_scale: T.Tensor((m, groups), "float"),
               w: T.Tensor((experts, n, k), E4M3), w_scale: T.Tensor((experts, n, groups), "float"),
               tile_expert: T.Tensor((tiles,), "int32"), tile_row: T.Tensor((tiles,), "int32"),
               tile_end: T.Tensor((tiles,), "int32"), y: T.Tensor((m, n), "float")):
        with T.Kernel(T.ceildiv(n, block_n), tiles, threads=threads) as (bn, bt):
            x_tile = T.alloc_shared((block_m, GROUP), E4M3)
            w_tile = T.alloc_shared((block_n, GROUP), E4M3)
            x_s = T.alloc_shared((block_m,), "float")
            w_s = T.alloc_shared((block_n,), "float")
            x_c = T.alloc_shared((block_m,), "float")
            w_c = T.alloc_shared((block_n,), "float")
            partial = T.alloc_fragment((block_m, block_n), "float")
            acc = T.alloc_fragment((block_m, block_n), "float")
            T.annotate_producer_reg_dealloc(PRODUCER_REGISTERS)
            T.annotate_consumer_reg_alloc(consumer_registers)
            T.use_swizzle(panel_size=swizzle)
            if tile_expert[bt] < experts:
                row, expert = tile_row[bt], tile_expert[bt]
                T.clear(acc)
                for kb in T.Pipelined(groups, num_stages=num_stages):
                    T.copy(x[row:row + block_m, kb * GROUP:(kb + 1) * GROUP], x_tile)
                    T.copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * GROUP:(kb + 1) * GROUP], w_tile)
                    for i in T.Parallel(block_m):
                        x_s[i] = T.if_then_else(row + i < m, x_scale[row + i, kb], 0.0)
                    for j in T.Parallel(block_n):
                        w_s[j] = T.if_then_else(bn * block_n + j < n, w_scale[expert, bn * block_n + j, kb], 0.0)
                    for i in T.Parallel(block_m):
                        x_c[i] = x_s[i]
                    for j in T.Parallel(block_n):
                        w_c[j] = w_s[j]
                    T.gemm(x_tile, w_tile, partial, transpose_B=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += partial[i, j] * (x_c[i] * w_c[j])
                for i, j in T.Parallel(block_m, block_n):
                    if i < tile_end[bt] - row and bn * block_n + j < n:
                        y[row + i, bn * block_n + j] = acc[i, j]

    return kernel


def align_reference(values: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``[..., k]`` and float32 scales ``[..., k/128]`` holding ``values`` (float ``[..., k]``,
    each group of 32 already a float exactly times ``2 ** exponents[..., k/32]``, int): per 128
    values the largest exponent ``E`` is kept, each group's values are multiplied by
    ``2 ** (its exponent - E)`` and rounded to e4m3 (nearest, ties to even), and the scale is
    ``2 ** E``. Exact while a group's values stay e4m3 numbers after the shift (for MXFP4
    weights, always when the exponents of a 128 span at most 14)."""
    lead = values.shape[:-1]
    k = values.shape[-1]
    exp = exponents.to(torch.int32).reshape(*lead, k // GROUP, GROUP // 32)
    top = exp.amax(-1, keepdim=True)
    shift = torch.exp2((exp - top).to(torch.float32)).unsqueeze(-1)
    grouped = values.to(torch.float32).reshape(*lead, k // GROUP, GROUP // 32, 32)
    data = (grouped * shift).reshape(*lead, k).to(torch.float8_e4m3fn)
    return data, torch.exp2(top.squeeze(-1).to(torch.float32))


def aligned(q) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., k], float32 scale [..., k/128])`` of a :class:`~deepinfer.hal.formats.Quantized`
    ``fp8`` or ``mxfp4`` operand with UE8M0 scales per 32 (byte 0 reads as a zero block, as in the
    other block-scaled kernels), by :func:`align_reference`: e4m3 values stay exact while they stay
    in e4m3's normal range after the shift, MXFP4 values while a group's scales span at most 14
    binades."""
    scale = q.scale.to(torch.int32)
    if q.fmt == "mxfp4":
        table = torch.tensor(_E2M1, device=q.data.device) * 2.0 ** MXFP4_SHIFT
        codes = torch.stack((q.data & 15, q.data >> 4), dim=-1).flatten(-2).long()
        values, exponents = table[codes], scale - 127 - MXFP4_SHIFT
    else:
        values, exponents = q.data.float(), scale - 127
    values = values.unflatten(-1, (-1, 32)).masked_fill((scale == 0).unsqueeze(-1), 0.0).flatten(-2)
    data, group_scale = align_reference(values, exponents)
    return data.contiguous(), group_scale.contiguous()


def reference(x, x_scale, w, w_scale, group_sizes) -> torch.Tensor:
    """float64 ``y`` of the kernel's operands, one matmul per expert segment, in float32."""
    xs = x.double() * x_scale.double().repeat_interleave(GROUP, dim=-1)
    out, start = torch.zeros(xs.shape[0], w.shape[1], dtype=torch.float32, device=xs.device), 0
    for expert, size in enumerate(group_sizes.tolist()):
        ws = w[expert].double() * w_scale[expert].double().repeat_interleave(GROUP, dim=-1)
        out[start:start + size] = (xs[start:start + size] @ ws.T).float()
        start += size
    return out


def run(x, x_scale, w, w_scale, group_sizes, **tiles) -> torch.Tensor:
    """Compile (cached by shape) and launch on ``x``'s device."""
    from deepinfer_backends.sm100.launch import compiled

    schedule = tile_schedule(group_sizes, x.shape[0], tiles.get("block_m", 128))
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        compiled(MODULE, "grouped_gemm_fp8_k128", *w.shape, **tiles)(x, x_scale, w, w_scale, *schedule, y)
    return y


def main() -> None:
    """Check against :func:`reference` (float64, relative to the largest ``|y|``) and time the tiles
    over compute-bound MoE shapes, beside ``torch._scaled_mm`` on 8192^3 (the card's dense FP8 rate)."""
    from tilelang.profiler import do_bench

    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    dense = 2 * 8192 ** 3 / do_bench(lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)) / 1e9
    print(f"torch._scaled_mm e4m3 8192^3: {dense:.0f} TFLOP/s")
    gen = torch.Generator("cuda").manual_seed(0)
    shapes = (("16 experts x 512 rows", 16, 512, 4096, 4096), ("16 experts x 2048 rows", 16, 2048, 4096, 4096),
              ("48 experts x 256 rows, w2", 48, 256, 4096, 2048), ("dense 8192^3", 1, 8192, 8192, 8192))
    configs = ({"block_m": 128, "block_n": 128, "threads": 256}, {"block_m": 128, "block_n": 192, "threads": 256},
               {"block_m": 192, "block_n": 128, "threads": 384})
    for label, experts, rows, n, k in shapes:
        sizes = torch.full((experts,), rows, dtype=torch.int64, device="cuda")
        x = torch.randn(experts * rows, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(experts, n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        exponents = torch.randint(-8, 0, (x.shape[0] + experts * n, k // GROUP), device="cuda", generator=gen)
        x_scale = torch.exp2(exponents[:x.shape[0]].float())
        w_scale = torch.exp2(exponents[x.shape[0]:].float()).reshape(experts, n, k // GROUP)
        want = reference(x, x_scale, w, w_scale, sizes)
        for tiles in configs:
            try:
                got = run(x, x_scale, w, w_scale, sizes, **tiles)
                error = ((got - want).abs().max() / want.abs().max()).item()
                ms = do_bench(lambda: run(x, x_scale, w, w_scale, sizes, **tiles))
            except Exception as exc:  # a tile that does not compile is reported, the sweep goes on
                print(f"{label} {tiles}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rate = 2 * x.shape[0] * n * k / ms / 1e9
            print(f"{label} m={x.shape[0]} n={n} k={k} {tiles}: {ms:.3f} ms {rate:.0f} TFLOP/s "
                  f"{rate / dense:.3f} of _scaled_mm, error {error:.1e} {'PASS' if error < 1e-3 else 'FAIL'}")

if __name__ == "__main__":
    main()

"""Block-scaled grouped GEMM on Hopper's native FP8 wgmma: FP8 activations x FP8 or MXFP4 expert weights.

Same contract as :func:`~deepinfer_backends.sm100.kernels.grouped_gemm_quant.grouped_gemm_quant`
with e4m3 activations (contiguous expert segments over the tile schedule of ``grouped_gemm.py``,
UE8M0 scales per 32 along K on both operands, float32 result), with the operands kept in 8 bits:

- a producer warpgroup streams e4m3 tiles by TMA into a ``num_stages`` ring (packed MXFP4 weights
  land in a raw ring and are decoded there to e4m3 by bit placement: code ``s ee m`` becomes the
  e4m3 byte ``s 0ee m00``, the e2m1 value times 2^-6, which the weight scale takes back), and
  turns each k-block's scale bytes into float32 powers of two (the byte as the exponent field);
- two consumer warpgroups, each on a 64-row tile, run one ``m64nNk32`` e4m3 wgmma per 32 values of
  K into a float32 partial that the wgmma clears, and promote it: ``acc += partial * (x_scale[row]
  * w_scale[col])``, one multiply and one fused multiply-add per element. With ``partials=2`` a
  warpgroup alternates two partials, so that the next wgmma runs on the tensor cores while the
  previous partial is promoted on the CUDA cores (but for each k-block's first wgmma: ptxas keeps
  no wgmma in flight over a loop's back edge); with ``partials=1`` only the other warpgroup
  overlaps them.

The promotion bounds the kernel: per element and per 32 values of K it costs two float32
instructions beside 32 tensor-core multiply-adds, and an SM issues 128 float32 lanes a clock
against 4096 e4m3 multiply-adds, so the kernel runs at most at half the tensor cores' e4m3 rate.
The scale product (two powers of two) and the partial's scaling are exact; UE8M0 byte 0 decodes to
0, and MXFP4 scale bytes above 248 overflow. Each partial carries the tensor cores' own
accumulation of 32 e4m3 products."""
import argparse
import json
import statistics
import subprocess
import sys

import tilelang
import tilelang.language as T
import torch

from deepinfer_backends.sm100.kernels.grouped_gemm_quant import BLOCK, W_FORMATS, _STORAGE

_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,  # every barrier is placed by hand
}
CONSUMERS = 256  # two consumer warpgroups; the producer warpgroup follows them
REGISTERS = (232, 40)  # per thread: consumers, producer; 256 * 232 + 128 * 40 is the 168 x 384 of launch
SHARED_BYTES = 227 * 1024
MXFP4_SCALE_SHIFT = 6  # the decoded e4m3 bytes hold the e2m1 value times 2^-6
MODULE = "experimental.grouped_gemm_fp8_wgmma"  # this module, as launch.compiled names kernel modules

PRELUDE = r"""
// 16 bytes of packed e2m1 (32 values, even index in the low nibble) -> 32 e4m3 bytes, each the
// e2m1 value times 2^-6: code s eem goes to bits 7 and 4..2 (e2m1's subnormal 0.5 lands on e4m3's).
__device__ __forceinline__ void fw_fp4x32_e4m3(const void* src, void* dst0, void* dst1) {
  uint4 v = *reinterpret_cast<const uint4*>(src);
  unsigned w[4] = {v.x, v.y, v.z, v.w}, o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned even = ((w[i] << 2) & 0x1C1C1C1Cu) | ((w[i] << 4) & 0x80808080u);
    unsigned odd = ((w[i] >> 2) & 0x1C1C1C1Cu) | (w[i] & 0x80808080u);
    o[2 * i] = __byte_perm(even, odd, 0x5140);
    o[2 * i + 1] = __byte_perm(even, odd, 0x7362);
  }
  *reinterpret_cast<uint4*>(dst0) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(dst1) = make_uint4(o[4], o[5], o[6], o[7]);
}
"""
"""CUDA device function ``fw_fp4x32_e4m3``: one 16-byte raw MXFP4 unit in, two 16-byte e4m3
chunks out (each one swizzle unit of the wgmma operand, so each takes its own address)."""


def stage_bytes(block_m: int, block_n: int, block_k: int, w_format: str) -> int:
    """Shared memory of one ring stage: e4m3 tiles, float32 scales, and the raw MXFP4 tile."""
    raw = block_n * block_k // 2 if w_format == "mxfp4" else 0
    return (block_m + block_n) * block_k + 4 * (block_m + block_n) * (block_k // BLOCK) + raw


def max_stages(block_m: int, block_n: int, block_k: int, w_format: str) -> int:
    """The deepest ring (at most 8) that fits a CTA's shared memory (1 KB kept spare)."""
    return min(8, (SHARED_BYTES - 1024) // stage_bytes(block_m, block_n, block_k, w_format))


def _ue8m0(byte, shift: int = 0):
    """float32 ``2 ** (byte + shift - 127)`` of a UE8M0 byte (byte 0 gives 0): the exponent field."""
    field = T.cast(byte, "int32")
    if shift:
        field = T.if_then_else(field == 0, 0, field + shift)
    return T.reinterpret(T.shift_left(field, 23), "float")


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def grouped_gemm_fp8_wgmma(experts: int, n: int, k: int, w_format: str, block_m: int = 128, block_n: int = 128,
                           block_k: int = 128, num_stages: int | None = None, partials: int = 2, swizzle: int = 8):
    """Kernel ``(x e4m3 [m, k], x_scale uint8 [m, k/32], w [experts, n, k or k/2], w_scale uint8
    [experts, n, k/32], tile_expert, tile_row, tile_end [tiles], y float32 [m, n])``: ``w`` e4m3
    (``w_format="fp8"``) or packed e2m1 (``"mxfp4"``, uint8 ``[experts, n, k/2]``). ``m`` and
    ``tiles`` are dynamic; ``tile_expert[t] >= experts`` marks an empty tile.

    ``block_m`` 128 (a consumer warpgroup per 64 rows; one whose rows all lie past a segment's end
    issues nothing) or 64 (the two split the columns); ``block_n`` divides ``n``, ``block_k`` (a
    multiple of 64) divides ``k``; ``num_stages`` defaults to as many as fit (:func:`max_stages`);
    ``partials`` (1 or 2) float32 partial tiles per consumer warpgroup."""
    if w_format not in W_FORMATS:
        raise ValueError(f"w_format={w_format!r}; expected one of {W_FORMATS}")
    wg_n = block_n if block_m == 128 else block_n // 2  # columns of one consumer warpgroup
    if block_m not in (64, 128) or wg_n % 8 or wg_n > 256 or n % block_n or partials not in (1, 2):
        raise ValueError(f"block_m={block_m} must be 64 or 128, block_n={block_n} must divide n={n} and give each "
                         f"consumer warpgroup a multiple of 8 columns up to 256, partials={partials} 1 or 2")
    if (1 + partials) * wg_n // 2 > 192:
        raise ValueError(f"{1 + partials} float32 tiles of 64 x {wg_n} need {(1 + partials) * wg_n // 2} registers a "
                         f"thread, over the 192 of the {REGISTERS[0]} a consumer thread has that tiles may take")
    if block_k % 64 or k % block_k:
        raise ValueError(f"k={k} must be a multiple of block_k={block_k}, itself a multiple of 64")
    num_stages = num_stages or max_stages(block_m, block_n, block_k, w_format)
    if not 2 <= num_stages or num_stages * stage_bytes(block_m, block_n, block_k, w_format) > SHARED_BYTES - 1024:
        raise ValueError(f"num_stages={num_stages}: at least 2, and at most "
                         f"{max_stages(block_m, block_n, block_k, w_format)} stages of "
                         f"{stage_bytes(block_m, block_n, block_k, w_format)} bytes fit shared memory")
    m = T.dynamic("m")
    tiles = T.dynamic("tiles")
    mxfp4 = w_format == "mxfp4"
    per_byte = 2 if mxfp4 else 1
    groups, k_blocks = block_k // BLOCK, k // block_k
    units = block_k // 2 // 16  # 16-byte raw MXFP4 units in a row of a k-block
    unit_iters = -(-block_n * units // 128)
    w_shift = MXFP4_SCALE_SHIFT if mxfp4 else 0

    def thread_order(c):
        """Where column ``c`` of a warpgroup's tile keeps its scale: the columns of the wgmma
        accumulator's lanes ``4 t + q`` (``8 i + 2 q`` and ``8 i + 2 q + 1``) side by side, so that
        each thread loads its columns' scales in 16-byte vectors."""
        return (c % 8) // 2 * (wg_n // 4) + c // 8 * 2 + c % 2

    @T.macro
    def issue(x_s, w_s, part, r0, c0, stage, g):
        """The warpgroup's wgmma of group ``g`` of ``stage`` into ``part`` (cleared by it)."""
        T.wgmma_gemm(x_s[stage, r0:r0 + 64, g * BLOCK:(g + 1) * BLOCK],
                     w_s[stage, c0:c0 + wg_n, g * BLOCK:(g + 1) * BLOCK], part, transpose_B=True, clear_accum=True)

    @T.macro
    def retire(acc, part, xs_f, ws_f, xf, wf, r0, c0, stage, g, in_flight: int):
        """Wait until at most ``in_flight`` wgmmas run, then promote ``part``, group ``g`` of ``stage``:
        ``acc += part * (x scale of the row * w scale of the column)``."""
        T.wait_wgmma(in_flight)
        T.warpgroup_fence_operand(part, num_regs=wg_n // 2)  # no read of it moves above the wait
        for i in T.Parallel(64):
            xf[i] = xs_f[stage, g, r0 + i]
        for j in T.Parallel(wg_n):
            wf[j] = ws_f[stage, g, c0 + thread_order(j)]
        for i, j in T.Parallel(64, wg_n):
            acc[i, j] += part[i, j] * (xf[i] * wf[j])

    @T.macro
    def consume(x_s, w_s, xs_f, ws_f, full, empty, acc, part0, part1, xf, wf, y, row0, rows, bn, r0, c0):
        """One consumer warpgroup: its 64 x ``wg_n`` tile at (``r0``, ``c0``) of the CTA's over the
        ring, then to ``y``. With two partials, group ``g``'s wgmma runs while group ``g - 1`` is
        promoted. ptxas serializes every wgmma where a wgmma stays in flight over the loop's back
        edge, where one sits under a branch, and where registers a wgmma wrote are read in a later
        iteration, so each k-block ends waiting for its last wgmma and a warpgroup whose rows all
        lie past the tile's ``rows`` takes another branch, which only keeps the ring turning."""
        if r0 < rows:
            T.clear(acc)
            for kb in T.serial(k_blocks):
                stage = kb % num_stages
                T.barrier_wait(full[stage], (kb // num_stages) & 1)
                if partials == 2:
                    for h in T.unroll(groups // 2):  # group 2h into part0, 2h + 1 into part1
                        issue(x_s, w_s, part0, r0, c0, stage, 2 * h)
                        if h > 0:
                            retire(acc, part1, xs_f, ws_f, xf, wf, r0, c0, stage, 2 * h - 1, 1)
                        issue(x_s, w_s, part1, r0, c0, stage, 2 * h + 1)
                        retire(acc, part0, xs_f, ws_f, xf, wf, r0, c0, stage, 2 * h, 1)
                    retire(acc, part1, xs_f, ws_f, xf, wf, r0, c0, stage, groups - 1, 0)
                else:
                    for g in T.unroll(groups):
                        issue(x_s, w_s, part0, r0, c0, stage, g)
                        retire(acc, part0, xs_f, ws_f, xf, wf, r0, c0, stage, g, 0)
                T.barrier_arrive(empty[stage])
            for i, j in T.Parallel(64, wg_n):
                if r0 + i < rows:
                    y[row0 + r0 + i, bn * block_n + c0 + j] = acc[i, j]
        else:
            for kb in T.serial(k_blocks):
                T.barrier_wait(full[kb % num_stages], (kb // num_stages) & 1)
                T.barrier_arrive(empty[kb % num_stages])

    @T.prim_func
    def kernel(x: T.Tensor((m, k), "float8_e4m3fn"), x_scale: T.Tensor((m, k // BLOCK), "uint8"),
               w: T.Tensor((experts, n, k // per_byte), _STORAGE[w_format]),
               w_scale: T.Tensor((experts, n, k // BLOCK), "uint8"), tile_expert: T.Tensor((tiles,), "int32"),
               tile_row: T.Tensor((tiles,), "int32"), tile_end: T.Tensor((tiles,), "int32"),
               y: T.Tensor((m, n), "float")):
        with T.Kernel(n // block_n, tiles, threads=CONSUMERS + 128, prelude=PRELUDE) as (bn, bt):
            x_s = T.alloc_shared((num_stages, block_m, block_k), "float8_e4m3fn")
            w_s = T.alloc_shared((num_stages, block_n, block_k), "float8_e4m3fn")
            w_raw = T.alloc_shared((num_stages, block_n, block_k // 2), "uint8") if mxfp4 else None
            xs_f = T.alloc_shared((num_stages, groups, block_m), "float")
            ws_f = T.alloc_shared((num_stages, groups, block_n), "float")
            # each consumer warpgroup its own fragments (a gemm over both would fence twice its registers)
            acc0, acc1 = T.alloc_fragment((64, wg_n), "float"), T.alloc_fragment((64, wg_n), "float")
            part00, part10 = T.alloc_fragment((64, wg_n), "float"), T.alloc_fragment((64, wg_n), "float")
            part01 = T.alloc_fragment((64, wg_n), "float") if partials == 2 else part00
            part11 = T.alloc_fragment((64, wg_n), "float") if partials == 2 else part10
            xf0, xf1 = T.alloc_fragment((64,), "float"), T.alloc_fragment((64,), "float")
            wf0, wf1 = T.alloc_fragment((wg_n,), "float"), T.alloc_fragment((wg_n,), "float")
            full = T.alloc_barrier([129] * num_stages)  # the producer threads and the tiles' TMA
            raw_full = T.alloc_barrier([1] * num_stages)
            empty = T.alloc_barrier([CONSUMERS] * num_stages)
            tx = T.get_thread_binding()
            T.use_swizzle(panel_size=swizzle)  # readers of one weight tile run together
            expert, row0 = tile_expert[bt], tile_row[bt]
            if expert < experts:
                if tx >= CONSUMERS:  # producer
                    T.set_max_nreg(REGISTERS[1], 0)
                    p = tx - CONSUMERS
                    for kb in T.serial(k_blocks):
                        stage = kb % num_stages
                        T.barrier_wait(empty[stage], ((kb // num_stages) & 1) ^ 1)
                        # every producer thread reaches the copies: TileLang elects the one that issues them with
                        # elect.sync over whole warps, which never returns on a lone thread of a warp
                        if mxfp4:
                            T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n,
                                         kb * block_k // 2:(kb + 1) * block_k // 2],
                                       w_raw[stage, :, :], barrier=raw_full[stage], annotations={"emit_arrive": 1})
                        else:
                            T.tma_copy(w[expert, bn * block_n:(bn + 1) * block_n, kb * block_k:(kb + 1) * block_k],
                                       w_s[stage, :, :], barrier=full[stage])
                        T.tma_copy(x[row0:row0 + block_m, kb * block_k:(kb + 1) * block_k], x_s[stage, :, :],
                                   barrier=full[stage], annotations={"emit_arrive": 1})
                        for i, g in T.Parallel(block_m, groups):
                            xs_f[stage, g, i] = T.if_then_else(row0 + i < m,
                                                               _ue8m0(x_scale[row0 + i, kb * groups + g]), 0.0)
                        for j, g in T.Parallel(block_n, groups):
                            ws_f[stage, g, j // wg_n * wg_n + thread_order(j % wg_n)] = \
                                _ue8m0(w_scale[expert, bn * block_n + j, kb * groups + g], w_shift)
                        if mxfp4:
                            T.barrier_wait(raw_full[stage], (kb // num_stages) & 1)
                            for it in T.unroll(unit_iters):
                                u = it * 128 + p
                                if block_n * units % 128 == 0 or u < block_n * units:
                                    T.call_extern("handle", "fw_fp4x32_e4m3",
                                                  T.access_ptr(w_raw[stage, u // units, (u % units) * 16], "r"),
                                                  T.access_ptr(w_s[stage, u // units, (u % units) * 32], "w"),
                                                  T.access_ptr(w_s[stage, u // units, (u % units) * 32 + 16], "w"))
                            T.fence_proxy_async()  # the generic-proxy stores must be visible to wgmma
                        T.barrier_arrive(full[stage])
                else:  # consumers
                    T.set_max_nreg(REGISTERS[0], 1)
                    rows = tile_end[bt] - row0
                    if tx < 128:
                        consume(x_s, w_s, xs_f, ws_f, full, empty, acc0, part00, part01, xf0, wf0, y,
                                row0, rows, bn, 0, 0)
                    else:
                        consume(x_s, w_s, xs_f, ws_f, full, empty, acc1, part10, part11, xf1, wf1, y,
                                row0, rows, bn, 64 if block_m == 128 else 0, 0 if block_m == 128 else wg_n)

    return kernel


SWEEP = ({"block_m": 128, "block_n": 128, "partials": 2}, {"block_m": 128, "block_n": 128, "partials": 1},
         {"block_m": 128, "block_n": 128, "block_k": 256, "partials": 2},
         {"block_m": 64, "block_n": 256, "partials": 2}, {"block_m": 64, "block_n": 256, "partials": 1})
"""Tile configurations :func:`main` checks and times on each shape."""
SHAPES = (("EP1 w13 E=384 M=24576 N=4096 K=4096 w=fp8", 384, 24576, 4096, 4096, "fp8"),
          ("EP8 w13 E=48 M=3072 N=4096 K=4096 w=fp8", 48, 3072, 4096, 4096, "fp8"),
          ("EP8 w2 E=48 M=12288 N=4096 K=2048 w=fp8", 48, 12288, 4096, 2048, "fp8"),
          ("EP8 w2 E=48 M=12288 N=4096 K=2048 w=mxfp4", 48, 12288, 4096, 2048, "mxfp4"))
"""The MoE shapes of ``experiments/results/sm100_fp8_gemm_h200.csv``, with equal expert segments."""
CHECK_SIZES = (0, 1, 63, 64, 65, 0, 129, 200)
"""Rows of the first experts in the checks (the others get none): empty experts, and segments that
end inside a tile, at its end and just past it."""
CHECK_TOLERANCE = 1e-4
"""Largest error the checks pass, relative to the largest output (the HAL's float32 ``rtol``)."""


def run(x, x_scale, w, w_scale, group_sizes, w_format: str, **tiles) -> torch.Tensor:
    """Compile (cached by shape) and launch on ``x``'s device: ``y`` float32 ``[m, n]``."""
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule
    from deepinfer_backends.sm100.launch import compiled

    schedule = tile_schedule(group_sizes, x.shape[0], tiles.get("block_m", 128))
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        compiled(MODULE, "grouped_gemm_fp8_wgmma", w.shape[0], w.shape[1], x.shape[1], w_format,
                 **tiles)(x, x_scale, w, w_scale, *schedule, y)
    return y


def reference(x, x_scale, w, w_scale, group_sizes, w_format: str, dtype=torch.float64) -> torch.Tensor:
    """``y`` in ``dtype`` from the operands dequantized exactly, one matmul per expert segment."""
    from deepinfer.hal.formats import Quantized

    xs = Quantized(x, x_scale, "fp8").dequantize().to(dtype)
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=dtype, device=x.device), 0
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            ws = Quantized(w[expert], w_scale[expert], w_format).dequantize().to(dtype)
            out[start:start + size] = xs[start:start + size] @ ws.T
        start += size
    return out


def tensor_core_reference(x, x_scale, w, w_scale, group_sizes, w_format: str) -> torch.Tensor:
    """``y`` in float64 from the float32 products of each 32 values of K that cuBLAS's e4m3 tensor
    cores make (``torch._scaled_mm``, rows padded to 16; MXFP4 placed on e4m3 as the kernel does),
    scaled and summed in float64: the kernel's result but for its float32 sums."""
    one, k = torch.ones((), device=x.device), x.shape[1]
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device), 0
    x_scale = (x_scale.to(torch.int32) << 23).view(torch.float32).double()
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            rows = torch.zeros(size + -size % 16, k, dtype=torch.uint8, device=x.device)
            rows[:size] = x[start:start + size].view(torch.uint8)
            data, scale = w[expert], w_scale[expert].to(torch.int32)
            if w_format == "mxfp4":
                codes = torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)
                data = ((codes & 8) << 4) | ((codes & 7) << 2)
                scale = torch.where(scale > 0, scale + MXFP4_SCALE_SHIFT, 0)
            data, scale = data.view(torch.uint8).view(torch.float8_e4m3fn), (scale << 23).view(torch.float32).double()
            for g in range(k // BLOCK):
                part = torch._scaled_mm(rows[:, g * BLOCK:(g + 1) * BLOCK].view(torch.float8_e4m3fn),
                                        data[:, g * BLOCK:(g + 1) * BLOCK].t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.float32)[:size]
                out[start:start + size] += part.double() * x_scale[start:start + size, g, None] * scale[:, g]
        start += size
    return out


def _random_codes(shape, fmt: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes (no NaN) or packed e2m1 bytes of ``shape`` values, and scale bytes 2^-7 .. 2^3."""
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] // (2 if fmt == "mxfp4" else 1)), generator=gen,
                         device="cuda", dtype=torch.uint8)
    if fmt == "fp8":
        data = torch.where((data & 0x7F) == 0x7F, data - 1, data).view(torch.float8_e4m3fn)
    return data, torch.randint(120, 131, (*shape[:-1], shape[-1] // BLOCK), generator=gen, device="cuda",
                               dtype=torch.uint8)


def _time_us(fn, reps: int = 10, rounds: int = 5) -> float:
    """Median microseconds a call over ``rounds`` of ``reps`` back-to-back calls (CUDA events)."""
    fn()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def _shape_child(index: int, configs: list[int]) -> None:
    """:func:`main`'s child process for one shape: the served path's time, then each config's check
    (``CHECK`` lines) and time, as ``RESULT`` lines; ``START i`` before config ``i``."""
    from deepinfer.hal.formats import Quantized, quantize
    from deepinfer_backends.sm100 import gemm
    from deepinfer_backends.sm100.launch import compiled

    name, experts, rows, n, k, w_format = SHAPES[index]
    gen = torch.Generator("cuda").manual_seed(0)
    w, w_scale = _random_codes((experts, n, k), w_format, gen)
    real = quantize(k ** -0.5 * torch.randn(len(CHECK_SIZES), n, k, generator=gen, device="cuda"), w_format)
    w[:len(CHECK_SIZES)], w_scale[:len(CHECK_SIZES)] = real.data, real.scale  # the experts the checks read
    x, x_scale = _random_codes((rows, k), "fp8", gen)
    sizes = torch.full((experts,), rows // experts, dtype=torch.int64, device="cuda")
    check_sizes = torch.zeros(experts, dtype=torch.int64, device="cuda")
    check_sizes[:len(CHECK_SIZES)] = torch.tensor(CHECK_SIZES)
    check_x = quantize(torch.randn(sum(CHECK_SIZES), k, generator=gen, device="cuda"), "fp8")
    check_args = (check_x.data, check_x.scale, w, w_scale, check_sizes, w_format)
    want = reference(*check_args)
    scale = want.abs().max().item()
    noise = (reference(*check_args, dtype=torch.float32) - want).abs().max().item() / scale
    try:
        tensor_cores = tensor_core_reference(*check_args)
    except Exception as error:  # a diagnostic only
        print(f"no tensor-core reference: {type(error).__name__}: {str(error)[:200]}", flush=True)
        tensor_cores = want

    def result(config: str, us: float, check: str = "") -> None:
        print("RESULT " + json.dumps({"shape": name, "config": config, "us": us, "check": check}), flush=True)

    served = gemm.quant_kernel(rows, experts, n, k, "sm_90a", w_format=w_format)
    result(f"served: {served[0]} {served[2]}", _time_us(lambda: gemm._grouped_gemm_quant(
        Quantized(x, x_scale, "fp8"), Quantized(w, w_scale, w_format), sizes, False)))
    for i in configs:
        print(f"START {i}", flush=True)
        try:
            got = run(*check_args, **SWEEP[i])
            err, tc_err = ((got - ref).abs().max().item() / scale for ref in (want, tensor_cores))
            check = f"{'PASS' if err <= CHECK_TOLERANCE else 'FAIL'} {err:.1e} (f32 {noise:.1e}, tc {tc_err:.1e})"
            print(f"CHECK {name} {SWEEP[i]}: {check}: max error over max |y| against float64; a float32 matmul's; "
                  f"the kernel's against the tensor cores' own products of 32", flush=True)
            y = torch.empty(rows, n, dtype=torch.float32, device="cuda")
            schedule = gemm.shared_schedule(sizes, rows, SWEEP[i]["block_m"], x.device, None)
            kernel = compiled(MODULE, "grouped_gemm_fp8_wgmma", experts, n, k, w_format, **SWEEP[i])
            result(json.dumps(SWEEP[i]), _time_us(lambda: kernel(x, x_scale, w, w_scale, *schedule, y)), check)
        except Exception as error:  # one config failing must not stop the others
            print(f"ERROR {name} {SWEEP[i]}: {type(error).__name__}: {str(error)[:400]}", flush=True)
            result(json.dumps(SWEEP[i]), float("nan"), f"ERROR {type(error).__name__}")


def _compile(job: tuple) -> str:
    """Compile one ``(module, factory, args, kwargs)`` for sm_90a into TileLang's disk cache."""
    from deepinfer_backends.sm100.launch import compile_kernel

    try:
        compile_kernel(*job, "sm_90a")
        return ""
    except Exception as error:
        return f"compile FAILED {job}: {type(error).__name__}: {str(error)[:300]}"


def _compile_all(jobs: int = 16) -> None:
    """Every kernel :func:`main` runs (the served path's too), compiled in ``jobs`` processes into
    TileLang's disk cache, where the child processes find them; failures are printed."""
    import multiprocessing

    from deepinfer_backends.sm100 import gemm

    kernels = {json.dumps(job): job for job in [
        *[(MODULE, "grouped_gemm_fp8_wgmma", (e, n, k, fmt), tiles)
          for _, e, _, n, k, fmt in SHAPES for tiles in SWEEP],
        *[(*gemm.quant_kernel(rows, e, n, k, "sm_90a", w_format=fmt)[:2], (e, n, k, fmt),
           gemm.quant_kernel(rows, e, n, k, "sm_90a", w_format=fmt)[2]) for _, e, rows, n, k, fmt in SHAPES]]}
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for failure in pool.imap_unordered(_compile, kernels.values()):
            if failure:
                print(failure, flush=True)


def _run_shape(index: int, idle_s: float = 40.0) -> list[dict]:
    """:func:`_shape_child` for shape ``index`` in a child process (a CUDA fault or a hang there
    spares the other shapes), its output echoed; a config silent for ``idle_s`` is reported hung
    and the child restarted after it. The results of the ``RESULT`` lines."""
    import select

    configs, results = list(range(len(SWEEP))), []
    while configs:
        child = subprocess.Popen([sys.executable, "-m", __spec__.name, "--child", str(index), "--configs",
                                  ",".join(map(str, configs))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        started = []

        def take(line: str) -> None:
            if line.startswith("START "):
                started.append(int(line.split()[1]))
            elif line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
            elif "[TileLang" not in line:
                print(line, end="", flush=True)

        while select.select([child.stdout], [], [], idle_s)[0] and (line := child.stdout.readline()):
            take(line)
        hung = child.poll() is None
        if hung:
            child.kill()
        for line in child.stdout:
            take(line)
        child.wait()
        if not hung or sum(row["shape"] == SHAPES[index][0] for row in results) == len(SWEEP) + 1:
            break  # a child silent after its last result (slow to exit) ran every config
        stuck = started[-1] if started else configs[0]
        print(f"HUNG {SHAPES[index][0]} {SWEEP[stuck]}", flush=True)
        results.append({"shape": SHAPES[index][0], "config": json.dumps(SWEEP[stuck]), "us": float("nan"),
                        "check": "HUNG"})
        configs = configs[configs.index(stuck) + 1:]
    return results


def main() -> None:
    """Check each swept config against the float64 reference on small uneven segments (empty experts
    among them) and time it on the MoE shapes beside the served path, on this GPU (an H200), with
    rates against ``torch._scaled_mm``'s e4m3 rate at 8192^3. Each shape runs in a child process."""
    parser = argparse.ArgumentParser(description=main.__doc__.split(" (")[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return _shape_child(args.child, [int(c) for c in args.configs.split(",")])
    _compile_all()
    a, b = (torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    one = torch.ones((), device="cuda")
    rate = 2 * 8192 ** 3 / _time_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16)) / 1e6
    print(f"torch._scaled_mm e4m3 8192^3: {rate:.0f} TFLOP/s", flush=True)
    del a, b
    torch.cuda.empty_cache()
    results = [row for index in range(len(SHAPES)) for row in _run_shape(index)]
    flops = {name: 2 * rows * n * k for name, _, rows, n, k, _ in SHAPES}
    print(f"\n{'shape':42} {'config':64} {'us':>8} {'TFLOP/s':>7} {'of rate':>7}  check")
    for row in results:
        tflops = flops[row["shape"]] / row["us"] / 1e6
        print(f"{row['shape']:42} {row['config'][:64]:64} {row['us']:8.1f} {tflops:7.1f} {tflops / rate:7.3f}  "
              f"{row['check']}")


if __name__ == "__main__":
    main()

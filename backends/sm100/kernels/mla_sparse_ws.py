"""Warp-specialised sparse MLA (MQA, V = K) through per-row index lists, with sink, out + lse.

Same contract as :func:`~deepinfer_backends.sm100.kernels.mla_sparse_decode.sparse_mla`, laid
out the way FlashMLA's decode kernel is: one CTA of three warpgroups per query row and 64 heads.

- the producer (warpgroup 2) gathers each block of ``block_k`` keys by cp.async: bf16 rows
  straight into a four-stage key ring; quantized rows (``fp8`` 528 B: e4m3 x UE8M0 per 32;
  ``fp4`` 288 B: e2m1 x e4m3 per 16) into a three-stage raw ring, two blocks ahead, then
  decoded to bf16 into a three-stage key ring by the ``key_decode`` device functions (eight
  values per call, one 16-byte store), in one rolled loop over the blocks; a lane per key row,
  each warp a quarter of the row, so that each thread loads its raw bytes into registers
  :data:`HELD_CALLS` calls at a time in a few 16-byte loads, the first ones before it waits for a
  free key slot;
- consumer 0 (warpgroup 0) computes the scores ``Q K^T`` (wgmma), the online softmax, and the
  left half of ``P V``;
- consumer 1 (warpgroup 1) computes the right half of ``P V`` from the probabilities consumer 0
  left in shared memory;
- the key lists are read first and only the consumers copy (and wait for) the queries, so the
  producer's first gather does not queue behind them; each consumer stores its half of the output
  through the queries' buffer as 16-byte vectors;
- the CTAs of one row's head blocks (128 heads: two) are neighbours in launch order, so the second
  finds the key rows the first gathered in L2 (in head-block-major order the two would gather the
  same rows far apart in time).

The running max is lazy (:data:`LAZY_LOG2`): it moves only when a block's scores pass it by more
than a factor 256, so after the first blocks almost no block rescales the output, and a warp
whose 16 rows all keep their max skips the 128 multiplies of its rescale.

They meet on mbarriers: ``k_ready`` / ``k_free`` per key stage, ``p_ready`` / ``p_free`` for the
probability tile, ``done`` for the final row scale. Every row walks its blocks in list order
whatever the batch, so with ``splits = 1`` the result is batch invariant (decode and prefill
alike, both with 32-key blocks).

The default for both sparse MLA ops on Hopper (``backend.options.mla_kernel=portable`` picks the
portable kernel instead): faster than the portable kernel on fp8 + fp4 decode, most at large
batches, and slightly faster on bf16 prefill (``experiments/results/mla_kernels_h200.txt``,
``experiments/results/sm100_design_measurements_h200.md``; ``experiments/mla_trace.py`` shows where
a CTA's time goes)."""
import tilelang
import tilelang.language as T

from deepinfer_backends.sm100.kernels import key_decode
from deepinfer_backends.sm100.kernels.mla_sparse_decode import NEG, ROW_BYTES, shared_macros

BLOCK_H = 64
_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    # Every barrier is placed by hand (mbarriers between warpgroups, named barriers inside one):
    # the automatic pass sees all dynamic shared memory as one buffer and would put a barrier in
    # each iteration of the producer's decode loop.
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
}
CONSUMER0_BAR, PRODUCER_BAR, CONSUMERS_BAR, CONSUMER1_BAR = 1, 2, 3, 4  # named barrier ids (0 is __syncthreads)
LAUNCH_REGISTERS = 168
"""Registers a thread of the 384 gets at launch; a warpgroup's budget above it is raised
(``setmaxnreg.inc``), one below it lowered (``setmaxnreg.dec``): raising to a smaller count is an
illegal instruction."""
HELD_CALLS = 4
"""Decode calls whose raw bytes a producer thread loads into registers at once (of its 16 a block of
32 keys, consecutive in one row: 32 bytes of fp8 or 16 of fp4): four is the fastest of the counts
compared (``experiments/results/sm100_design_measurements_h200.md``)."""
LAZY_LOG2 = 8.0
"""A row's running max moves only when a block's scores pass it by more than this (log2 units), so
probabilities stay at most ``2**LAZY_LOG2`` and most blocks rescale nothing (the output is divided
by the same sum in the end, so the result holds whatever max the row settled on)."""
ROWS_MOVED = r'''
// 1 in every lane when one of this warp's 16 rows (of a 64-row wgmma tile) has a factor other than 1.
__device__ __forceinline__ int mla_rows_moved(const float* alpha, int warp) {
  int lane = threadIdx.x & 31;
  return __any_sync(0xffffffffu, lane < 16 && alpha[warp * 16 + lane] != 1.0f);
}
'''


def check_config(heads: int, dim: int, extra_keys: int, main_format: str) -> None:
    """Raise ``ValueError`` for a configuration this kernel does not cover."""
    if heads % BLOCK_H or dim % 64 or not 64 <= dim <= 512 or main_format not in ("bf16", "fp8") \
            or (main_format == "fp8" and dim != 512) or (extra_keys and (dim != 512 or main_format != "fp8")):
        raise ValueError(f"sparse_mla_ws: heads={heads} must be a multiple of {BLOCK_H}, dim={dim} a multiple of 64 "
                         f"up to 512; main_format {main_format!r} must be 'bf16' or 'fp8' (fp8 rows hold 512 values),"
                         f" and an fp4 extra list needs the fp8 main format")


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def sparse_mla_ws(heads: int, dim: int, main_keys: int, extra_keys: int, scale: float, main_format: str = "fp8",
                  splits: int = 1, block_k: int = 32, registers: tuple | None = None, key_stages: int | None = None,
                  raw_stages: int = 3, held_calls: int = HELD_CALLS):
    """Kernel ``(q [rows, heads, dim] bf16, main, main_idx [rows, main_keys], extra uint8 [r2, 288],
    extra_idx [rows, max(extra_keys, 1)], sink f32 [heads], out, lse)`` with the layouts of
    ``sparse_mla``: ``out`` / ``lse`` bf16 / f32 when ``splits == 1``, else float32 partials
    ``[splits, rows, heads, dim]`` / ``[splits, rows, heads]`` for ``combine``.

    bf16 keys go by cp.async straight into a key ring of ``key_stages`` (default 4). Quantized rows
    go by cp.async into a ring of ``raw_stages`` raw blocks (``raw_stages - 1`` in flight), and the
    producer decodes each block into a key ring of ``key_stages`` (default 3; the consumers' loops
    are unrolled over it, so their ring slots are static). ``registers``: each warpgroup's register
    budget (consumer 0, consumer 1, producer; multiples of 8, at most three times
    :data:`LAUNCH_REGISTERS` together); by default (208, 160, 136) with quantized rows, whose
    decoding producer holds ``held_calls`` calls' raw bytes in registers at a time, else (240, 168,
    96)."""
    quantized = main_format != "bf16"
    registers = registers or ((208, 160, 136) if quantized else (240, 168, 96))
    if len(registers) != 3 or sum(registers) > 3 * LAUNCH_REGISTERS \
            or any(count % 8 or not 24 <= count <= 256 for count in registers):
        raise ValueError(f"sparse_mla_ws: registers {registers} must be three multiples of 8 from 24 to 256 that add "
                         f"up to at most {3 * LAUNCH_REGISTERS}")
    check_config(heads, dim, extra_keys, main_format)
    rows, main_rows, extra_rows = T.dynamic("rows"), T.dynamic("main_rows"), T.dynamic("extra_rows")
    main_shape = (main_rows, dim) if main_format == "bf16" else (main_rows, ROW_BYTES["fp8"])
    main_dtype = "bfloat16" if main_format == "bf16" else "uint8"
    out_shape, out_dtype = ((rows, heads, dim), "bfloat16") if splits == 1 else ((splits, rows, heads, dim), "float")
    lse_shape = (rows, heads) if splits == 1 else (splits, rows, heads)
    main_blocks, extra_blocks = -(-main_keys // (block_k * splits)), -(-extra_keys // (block_k * splits))
    blocks = main_blocks + extra_blocks
    half = dim // 2
    head_blocks = heads // BLOCK_H
    k_stages = key_stages or (3 if quantized else 4)
    raw_stages = raw_stages if quantized else 1
    if k_stages < 2 or raw_stages < (2 if quantized else 1):
        raise ValueError(f"sparse_mla_ws: key_stages={k_stages} must be at least 2 and raw_stages={raw_stages} at "
                         f"least 2 with quantized rows")
    rounds = -(-blocks // k_stages)
    ahead = raw_stages - 1  # raw blocks in flight beyond the one being decoded
    shared = shared_macros(BLOCK_H, block_k, dim, main_format, scale, splits, lazy_log2=LAZY_LOG2)
    chunks_main, chunks_extra = ROW_BYTES["fp8"] // 16, ROW_BYTES["fp4"] // 16  # 16-byte cp.async units per row
    chunks_bf16 = dim * 2 // 16
    calls = block_k * dim // 8 // 128  # decode calls of eight values a producer thread makes per block
    if quantized and block_k != 32:
        raise ValueError(f"sparse_mla_ws: block_k={block_k} must be 32 with quantized rows (a lane per row)")
    if quantized and (held_calls < 1 or calls % min(calls, held_calls)):
        raise ValueError(f"sparse_mla_ws: held_calls={held_calls} must divide the {calls} decode calls a producer "
                         f"thread makes per block")
    held_calls = min(calls, held_calls)

    def row_and_chunk(part, c, p):
        """Row of the block and 8-value chunk of it that producer thread ``p`` decodes in its call
        ``c`` of register batch ``part``: a lane per row, each warp a quarter of the row's chunks in
        order, so that a batch's raw bytes are one run (a few wide shared-memory loads) and a
        quarter-warp's stores land in eight rows' distinct swizzle chunks (no bank conflicts)."""
        return p % 32, (p // 32) * calls + part * held_calls + c

    def rows_moved(alpha_s, warp):
        """Whether a row of ``warp`` (of its warpgroup) has to rescale its output this block."""
        return T.call_extern("int32", "mla_rows_moved", T.access_ptr(alpha_s[0], "r"), warp) != 0

    @T.macro
    def store_half(acc_o, q_s, out, row, hb, split, col0, bar):
        """A consumer's half of the output, ``[64, half]``, from its accumulators. bf16 goes through
        shared memory (the queries' buffer, free once the last scores are in) so that the stores to
        global memory are whole 16-byte vectors of consecutive addresses: 4-byte stores straight from
        the accumulator layout spread each warp store over 8 rows and slow the end of every row.
        Float32 partials (split-KV) would need twice that buffer and go straight."""
        if splits == 1:
            T.copy(acc_o, q_s[:, col0:col0 + half])
            T.sync_threads(bar, 128)
            T.copy(q_s[:, col0:col0 + half], out[row, hb * BLOCK_H:(hb + 1) * BLOCK_H, col0:col0 + half])
        else:
            T.copy(acc_o, out[split, row, hb * BLOCK_H:(hb + 1) * BLOCK_H, col0:col0 + half])

    @T.macro
    def wait_for_q():
        """A consumer thread's wait until both consumers' copies of q have landed."""
        T.ptx_wait_group(0)
        T.fence_proxy_async()  # q is read by wgmma
        T.sync_threads(CONSUMERS_BAR, 256)

    @T.macro
    def load_keys(main_idx, extra_idx, main_rows, extra_rows, row, split, keys_s):
        """This split's key blocks as one list: its slice of the main list, then of the extra list
        (indices past a list's end or its cache read as -1)."""
        for p in T.Parallel(blocks * block_k):
            col_main = (split * main_blocks + p // block_k) * block_k + p % block_k
            col_extra = (split * extra_blocks + p // block_k - main_blocks) * block_k + p % block_k
            keys_s[p] = T.if_then_else(
                p < main_blocks * block_k,
                T.if_then_else(col_main < main_keys, T.if_then_else(main_idx[row, T.min(col_main, main_keys - 1)]
                                                                    < main_rows,
                                                                    main_idx[row, T.min(col_main, main_keys - 1)], -1),
                               -1),
                T.if_then_else(col_extra < extra_keys,
                               T.if_then_else(extra_idx[row, T.min(col_extra, max(extra_keys, 1) - 1)] < extra_rows,
                                              extra_idx[row, T.min(col_extra, max(extra_keys, 1) - 1)], -1), -1))

    @T.macro
    def fetch_rows(cache, chunks, keys_s, t, raw, slot, p):
        """Issue this producer thread's share of block ``t``'s raw rows of ``cache`` (``chunks``
        16-byte cp.async units a row; a padding key's row is zero-filled, and zero bytes decode to 0)."""
        for c in T.unroll(-(-block_k * chunks // 128)):
            unit = c * 128 + p
            if unit < block_k * chunks:
                key = keys_s[t * block_k + unit // chunks]
                T.ptx_cp_async(T.access_ptr(raw[slot, unit // chunks, (unit % chunks) * 16], "w", 16),
                               T.access_ptr(cache[T.max(key, 0), (unit % chunks) * 16], "r", 16), 16,
                               predicate=key >= 0)

    @T.macro
    def fetch_raw(main, extra, keys_s, t, raw, slot, p):
        """Block ``t``'s raw rows: from the main cache for its first blocks, then from the extra cache."""
        if t < main_blocks:
            fetch_rows(main, chunks_main, keys_s, t, raw, slot, p)
        elif extra_keys:
            fetch_rows(extra, chunks_extra, keys_s, t, raw, slot, p)

    @T.macro
    def fetch_bf16(main, keys_s, t, k_s, stage, p):
        for c in T.unroll(block_k * chunks_bf16 // 128):
            unit = c * 128 + p
            key = keys_s[t * block_k + unit // chunks_bf16]
            T.ptx_cp_async(T.access_ptr(k_s[stage, unit // chunks_bf16, (unit % chunks_bf16) * 8], "w", 8),
                           T.access_ptr(main[T.max(key, 0), (unit % chunks_bf16) * 8], "r", 8), 8,
                           predicate=key >= 0)

    @T.macro
    def load_part(t, raw, slot, p, held, scale, part):
        """This thread's raw bytes of calls ``part * held_calls ..`` of block ``t`` (fp8 main rows,
        then fp4 extra rows) into registers, all before the part's first decode store (the compiler
        cannot move a load past a store that may alias it)."""
        i, q = row_and_chunk(part, 0, p)
        if t < main_blocks:
            key_decode.load_run(raw, slot, i, q, "fp8", held, scale, held_calls)
        elif extra_keys:
            key_decode.load_run(raw, slot, i, q, "fp4", held, scale, held_calls)

    @T.macro
    def decode_part(t, k_s, stage, p, held, scale, part):
        """The bytes :func:`load_part` holds -> bf16 keys, eight values per call."""
        for c in T.unroll(held_calls):
            i, q = row_and_chunk(part, c, p)
            if t < main_blocks:
                key_decode.store8(held, scale, c, "fp8", k_s, stage, i, q)
            elif extra_keys:
                key_decode.store8(held, scale, c, "fp4", k_s, stage, i, q)

    @T.prim_func
    def kernel(q: T.Tensor((rows, heads, dim), "bfloat16"), main: T.Tensor(main_shape, main_dtype),
               main_idx: T.Tensor((rows, main_keys), "int32"), extra: T.Tensor((extra_rows, 288), "uint8"),
               extra_idx: T.Tensor((rows, max(extra_keys, 1)), "int32"), sink: T.Tensor((heads,), "float"),
               out: T.Tensor(out_shape, out_dtype), lse: T.Tensor(lse_shape, "float")):
        with T.Kernel(rows * head_blocks, splits, threads=384,
                      prelude=key_decode.PRELUDE + ROWS_MOVED) as (bx, split):
            row, hb = bx // head_blocks, bx % head_blocks  # a row's head blocks run together
            q_s = T.alloc_shared((BLOCK_H, dim), "bfloat16")
            k_s = T.alloc_shared((k_stages, block_k, dim), "bfloat16")
            raw = T.alloc_shared((raw_stages, block_k if quantized else 1, ROW_BYTES["fp8"]), "uint8")
            p_s = T.alloc_shared((BLOCK_H, block_k), "bfloat16")
            alpha_s = T.alloc_shared((BLOCK_H,), "float")
            gate_s = T.alloc_shared((BLOCK_H,), "float")
            keys_s = T.alloc_shared((max(blocks, 1) * block_k,), "int32")
            k_ready = T.alloc_barrier(arrive_count=[128] * k_stages)
            k_free = T.alloc_barrier(arrive_count=[256] * k_stages)
            p_ready = T.alloc_barrier(arrive_count=256)
            p_free = T.alloc_barrier(arrive_count=256)
            done = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            load_keys(main_idx, extra_idx, main_rows, extra_rows, row, split, keys_s)  # first: the producer needs it
            if tx < 256:  # the consumers copy q (cp.async, 16 bytes a thread at a time); only they wait for it
                for c in T.unroll(-(-BLOCK_H * dim // 8 // 256)):
                    unit = c * 256 + tx
                    if unit < BLOCK_H * dim // 8:
                        T.ptx_cp_async(T.access_ptr(q_s[unit // (dim // 8), (unit % (dim // 8)) * 8], "w", 8),
                                       T.access_ptr(q[row, hb * BLOCK_H + unit // (dim // 8), (unit % (dim // 8)) * 8],
                                                    "r", 8), 8)
                T.ptx_commit_group()
            T.sync_threads()  # the key list is whole; the producer starts its gather while q lands

            if tx < 128:  # consumer 0: scores, softmax, left half of P V
                T.set_max_nreg(registers[0], int(registers[0] >= LAUNCH_REGISTERS))
                wait_for_q()
                acc_s = T.alloc_fragment((BLOCK_H, block_k), "float")
                acc_o = T.alloc_fragment((BLOCK_H, half), "float")
                m = T.alloc_fragment((BLOCK_H,), "float")
                m_prev = T.alloc_fragment((BLOCK_H,), "float")
                alpha = T.alloc_fragment((BLOCK_H,), "float")
                l = T.alloc_fragment((BLOCK_H,), "float")
                l_block = T.alloc_fragment((BLOCK_H,), "float")
                gate = T.alloc_fragment((BLOCK_H,), "float")
                lse_row = T.alloc_fragment((BLOCK_H,), "float")
                T.fill(acc_o, 0)
                T.fill(l, 0)
                T.fill(m, NEG)
                for r in T.serial(rounds):
                    for j in T.unroll(k_stages):
                        t = r * k_stages + j
                        if t < blocks:
                            T.barrier_wait(k_ready[j], (t // k_stages) & 1)
                            T.gemm(q_s, k_s[j, :, :], acc_s, transpose_B=True, clear_accum=True)
                            if t > 0:  # consumer 1 is done with the previous p_s and alpha_s
                                T.barrier_arrive(p_free)
                                T.barrier_wait(p_free, (t - 1) & 1)
                            shared.softmax_step(acc_s, keys_s, t * block_k, m, m_prev, alpha, l, l_block)
                            T.copy(alpha, alpha_s)
                            T.copy(acc_s, p_s)
                            T.fence_proxy_async()
                            T.sync_threads(CONSUMER0_BAR, 128)  # p_s and alpha_s whole
                            if rows_moved(alpha_s, tx // 32):
                                for i, jj in T.Parallel(BLOCK_H, half):
                                    acc_o[i, jj] *= alpha[i]
                            T.gemm(p_s, k_s[j, :, 0:half], acc_o)
                            T.barrier_arrive(p_ready)
                            T.barrier_arrive(k_free[j])
                shared.row_stats(m, l, sink, hb, lse_row, gate)
                T.copy(gate, gate_s)
                T.barrier_arrive(done)
                for i, jj in T.Parallel(BLOCK_H, half):
                    acc_o[i, jj] *= gate[i]
                store_half(acc_o, q_s, out, row, hb, split, 0, CONSUMER0_BAR)
                if splits == 1:
                    T.copy(lse_row, lse[row, hb * BLOCK_H:(hb + 1) * BLOCK_H])
                else:
                    T.copy(lse_row, lse[split, row, hb * BLOCK_H:(hb + 1) * BLOCK_H])
            elif tx < 256:  # consumer 1: right half of P V
                T.set_max_nreg(registers[1], int(registers[1] >= LAUNCH_REGISTERS))
                wait_for_q()
                acc_o = T.alloc_fragment((BLOCK_H, half), "float")
                T.fill(acc_o, 0)
                for r in T.serial(rounds):
                    for j in T.unroll(k_stages):
                        t = r * k_stages + j
                        if t < blocks:
                            T.barrier_arrive(p_ready)
                            T.barrier_wait(p_ready, t & 1)
                            if rows_moved(alpha_s, tx // 32 - 4):  # its warps hold the same rows
                                for i, jj in T.Parallel(BLOCK_H, half):
                                    acc_o[i, jj] *= alpha_s[i]
                            T.gemm(p_s, k_s[j, :, half:dim], acc_o)
                            T.barrier_arrive(k_free[j])
                            if t < blocks - 1:
                                T.barrier_arrive(p_free)
                T.barrier_wait(done, 0)
                for i, jj in T.Parallel(BLOCK_H, half):
                    acc_o[i, jj] *= gate_s[i]
                store_half(acc_o, q_s, out, row, hb, split, half, CONSUMER1_BAR)
            else:  # producer: gather (and decode) key blocks into the ring
                T.set_max_nreg(registers[2], int(registers[2] >= LAUNCH_REGISTERS))
                p = tx - 256
                if quantized:
                    held = T.alloc_local((held_calls * 8,), "uint8")  # raw bytes, 8 (fp8) or 4 (fp4) a call
                    scale = T.alloc_local((held_calls,), "int32")
                    for d in T.unroll(ahead):
                        if d < blocks:
                            fetch_raw(main, extra, keys_s, d, raw, d, p)
                        T.ptx_commit_group()
                for t in T.serial(blocks):  # rolled: one copy of each decode loop (instruction fetch)
                    stage = t % k_stages
                    if quantized:
                        T.ptx_wait_group(ahead - 1)  # this thread's copies of block t have landed
                        T.sync_threads(PRODUCER_BAR, 128)  # everyone's have; slot t-1 is decoded
                        if t + ahead < blocks:
                            fetch_raw(main, extra, keys_s, t + ahead, raw, (t + ahead) % raw_stages, p)
                        T.ptx_commit_group()
                        load_part(t, raw, t % raw_stages, p, held, scale, 0)  # before the wait for a free slot
                        T.barrier_wait(k_free[stage], ((t // k_stages) & 1) ^ 1)
                        for part in T.unroll(calls // held_calls):
                            if part > 0:
                                load_part(t, raw, t % raw_stages, p, held, scale, part)
                            decode_part(t, k_s, stage, p, held, scale, part)
                        T.fence_proxy_async()  # the generic-proxy stores must be visible to wgmma
                        T.barrier_arrive(k_ready[stage])
                    else:
                        T.barrier_wait(k_free[stage], ((t // k_stages) & 1) ^ 1)
                        fetch_bf16(main, keys_s, t, k_s, stage, p)
                        T.cp_async_barrier_noinc(k_ready[stage])

    return kernel


def main() -> None:
    """Check the warp-specialised sparse MLA kernel against the OpSpec reference and tolerance on this GPU
    (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("mla_sparse_decode", "mla_sparse_prefill", mla_kernel="warp_specialized")


if __name__ == "__main__":
    main()

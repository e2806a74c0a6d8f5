"""Sparse MLA (MQA, V = K) through per-row index lists, with attention sink, out + lse.

One CTA takes one query row and ``block_h`` heads (the wrapper pads heads to a multiple of
``block_h``) and walks its key lists (main, then extra) in blocks of ``block_k`` keys. Each block
is gathered into shared memory by cp.async, pipelined ``num_stages`` deep (``bf16`` rows straight
into the key tile; quantized rows copied raw and decoded there to bf16: ``fp8`` 528 B rows hold
512 e4m3 + 16 UE8M0 per-32 scales, ``fp4`` 288 B rows 256 B packed e2m1 + 32 e4m3 per-16
scales), then ``Q K^T`` and ``P K`` run on the tensor cores (wgmma on sm_90a) with an online
softmax in float32. Keys outside the list (``-1``, or past the cache) read as zeros and are
masked. With ``splits > 1`` each CTA takes one slice of each list and writes a float32 partial
(out, lse) that :func:`combine` merges; ``splits = 1`` (the batch-invariant choice) finishes in
place. The sink scales each row by ``sigmoid(lse - sink[h])``."""
from types import SimpleNamespace

import tilelang
import tilelang.language as T
import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG = -1.0e30  # running-max start: finite, so a block with no valid key gives exp2(-inf - NEG) = 0
ROW_BYTES = {"bf16": 1024, "fp8": 528, "fp4": 288}
STATIC_LIST_BYTES = 32 * 1024  # of the 48 KB of static shared memory a CTA may hold
_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


def check_config(heads: int, dim: int, extra_keys: int, main_format: str, block_h: int) -> None:
    """Raise ``ValueError`` for a ``sparse_mla`` configuration the kernels do not cover."""
    if heads % block_h or main_format not in ("bf16", "fp8") or (main_format == "fp8" and dim != 512):
        raise ValueError(f"sparse_mla: heads={heads} must be a multiple of block_h={block_h}; main_format "
                         f"{main_format!r} must be 'bf16' or 'fp8' (fp8 rows hold 512 values, dim={dim})")
    if extra_keys and (dim != 512 or main_format != "fp8"):
        raise ValueError(f"sparse_mla: an fp4 extra list needs the fp8 main format and dim 512 (the pipelined "
                         f"key tile is filled by cp.async for bf16 but by the decoder for quantized rows); got "
                         f"{main_format!r}, dim={dim}")


def shared_macros(block_h: int, block_k: int, dim: int, main_format: str, scale: float, splits: int,
                  lazy_log2: float | None = None) -> SimpleNamespace:
    """The macros every sparse MLA kernel is made of (this one, ``mla_sparse_decode_tcgen05`` and
    ``mla_sparse_ws``): staging a key list, filling the fp4 code table, gathering and decoding one key
    block into ``k_s``, the online-softmax step on one block of scores, and each row's lse and
    output scale. With ``lazy_log2`` the softmax step's running max is lazy: it moves only when a
    block's scores pass it by more than that (log2 units)."""
    scale_log2 = scale * LOG2E

    @T.macro
    def load_indices(idx, count, limit, row, idx_s):
        for p in T.Parallel(T.max(count, 1)):
            idx_s[p] = T.if_then_else(idx[row, p] < limit, idx[row, p], -1)
        for p in T.Parallel(idx_s.shape[0] - count):
            idx_s[count + p] = -1

    @T.macro
    def fill_fp4_values(fp4_values):
        for c in T.Parallel(16):  # e2m1 code -> value: 0, .5, 1, 1.5, 2, 3, 4, 6 (bit 3: sign)
            fp4_values[c] = T.if_then_else(
                (c & 6) == 0, 0.5 * (c & 1),
                (1.0 + 0.5 * (c & 1)) * T.cast(T.shift_left(1, ((c & 6) >> 1) - 1), "float")) \
                * T.if_then_else(c >= 8, -1.0, 1.0)

    @T.macro
    def gather_main(main, idx_s, base, raw, k_s):
        """Keys ``idx_s[base:base + block_k]`` of the main cache into ``k_s`` as bf16. A padding
        index (-1) is out of bounds, which the generated bounds predicate turns into a zero fill
        (zero bytes decode to 0, so padding keys add nothing)."""
        if main_format == "bf16":
            for i, j in T.Parallel(block_k, dim):
                k_s[i, j] = main[idx_s[base + i], j]
        else:
            for i, c in T.Parallel(block_k, ROW_BYTES["fp8"]):
                raw[i, c] = main[idx_s[base + i], c]
            for i, v in T.Parallel(block_k, dim // 8):  # UE8M0 byte b -> 2^(b-127) as float bits b << 23
                for e in T.vectorized(8):
                    k_s[i, v * 8 + e] = T.cast(
                        T.cast(T.reinterpret(raw[i, v * 8 + e], "float8_e4m3fn"), "float")
                        * T.reinterpret(T.shift_left(T.cast(raw[i, 512 + v // 4], "int32"), 23), "float"),
                        "bfloat16")

    @T.macro
    def gather_extra(extra, idx_s, base, raw, fp4_values, k_s):
        """Keys ``idx_s[base:base + block_k]`` of the fp4 extra cache into ``k_s`` as bf16."""
        for i, c in T.Parallel(block_k, ROW_BYTES["fp4"]):
            raw[i, c] = extra[idx_s[base + i], c]
        for i, v in T.Parallel(block_k, dim // 8):
            for e in T.vectorized(8):
                k_s[i, v * 8 + e] = T.cast(
                    fp4_values[(raw[i, v * 4 + e // 2] >> ((e % 2) * 4)) & 15]
                    * T.cast(T.reinterpret(raw[i, 256 + v // 2], "float8_e4m3fn"), "float"), "bfloat16")

    @T.macro
    def softmax_step(acc_s, idx_s, base, m, m_prev, alpha, l, l_block):
        """Scores ``acc_s`` of one key block -> unnormalised probabilities ``exp2(s - m)``; updates
        the running max ``m`` and sum ``l`` and leaves in ``alpha`` the factor for earlier output
        (exactly 1 for a row whose lazy max stays)."""
        for i, j in T.Parallel(block_h, block_k):
            acc_s[i, j] = T.if_then_else(idx_s[base + j] >= 0, acc_s[i, j] * scale_log2, -T.infinity("float"))
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for i in T.Parallel(block_h):
            if lazy_log2 is None:
                alpha[i] = T.exp2(m_prev[i] - m[i])
            else:
                alpha[i] = T.if_then_else(m[i] > m_prev[i] + lazy_log2, T.exp2(m_prev[i] - m[i]), 1.0)
                m[i] = T.if_then_else(m[i] > m_prev[i] + lazy_log2, m[i], m_prev[i])
        for i, j in T.Parallel(block_h, block_k):
            acc_s[i, j] = T.exp2(acc_s[i, j] - m[i])
        T.reduce_sum(acc_s, l_block, dim=1)
        for i in T.Parallel(block_h):
            l[i] = l[i] * alpha[i] + l_block[i]

    @T.macro
    def row_stats(m, l, sink, hb, lse_row, gate):
        """Each head's lse and the factor its output is scaled by: ``sigmoid(lse - sink) / l``
        when ``splits == 1``, else ``1 / l`` (the sink is applied by :func:`combine`)."""
        for i in T.Parallel(block_h):
            lse_row[i] = T.if_then_else(l[i] > 0, (m[i] + T.log2(l[i])) * LN2, -T.infinity("float"))
        if splits == 1:
            for i in T.Parallel(block_h):
                gate[i] = T.if_then_else(l[i] > 0, 1.0 / ((1.0 + T.exp(sink[hb * block_h + i] - lse_row[i])) * l[i]),
                                         0.0)
        else:
            for i in T.Parallel(block_h):
                gate[i] = T.if_then_else(l[i] > 0, 1.0 / l[i], 0.0)

    return SimpleNamespace(load_indices=load_indices, fill_fp4_values=fill_fp4_values, gather_main=gather_main,
                           gather_extra=gather_extra, softmax_step=softmax_step, row_stats=row_stats)


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def sparse_mla(heads: int, dim: int, main_keys: int, extra_keys: int, scale: float, main_format: str = "fp8",
               splits: int = 1, block_h: int = 64, block_k: int = 64, num_stages: int = 2, threads: int = 256):
    """Kernel ``(q [rows, heads, dim] bf16, main, main_idx [rows, main_keys], extra uint8 [r2, 288],
    extra_idx [rows, max(extra_keys, 1)], sink f32 [heads], out, lse)``.

    ``main`` is ``bf16 [r1, dim]`` (``main_format="bf16"``) or the fp8 rows as ``uint8 [r1, 528]``. ``extra_keys = 0`` leaves ``extra`` unread. ``out``/``lse`` are
    ``bf16 [rows, heads, dim]`` / ``f32 [rows, heads]`` when ``splits == 1``, else float32
    partials ``[splits, rows, heads, dim]`` / ``[splits, rows, heads]``."""
    check_config(heads, dim, extra_keys, main_format, block_h)
    rows, main_rows, extra_rows = T.dynamic("rows"), T.dynamic("main_rows"), T.dynamic("extra_rows")
    main_shape = (main_rows, dim) if main_format == "bf16" else (main_rows, ROW_BYTES["fp8"])
    main_dtype = "bfloat16" if main_format == "bf16" else "uint8"
    out_shape, out_dtype = ((rows, heads, dim), "bfloat16") if splits == 1 else ((splits, rows, heads, dim), "float")
    lse_shape = (rows, heads) if splits == 1 else (splits, rows, heads)
    main_per_split, extra_per_split = -(-main_keys // (block_k * splits)), -(-extra_keys // (block_k * splits))
    shared = shared_macros(block_h, block_k, dim, main_format, scale, splits)
    list_sizes = (splits * main_per_split * block_k, max(splits * extra_per_split, 1) * block_k)
    # The key lists go to static shared memory when they fit: TileLang's sync pass sees all dynamic
    # shared memory as one buffer, so a gather loop reading a list there would get a barrier per iteration.
    list_scope = "shared" if 4 * sum(list_sizes) <= STATIC_LIST_BYTES else "shared.dyn"

    @T.macro
    def attend(q_s, k_s, p_s, idx_s, base, acc_s, acc_o, m, m_prev, alpha, l, l_block):
        """One key block of the online softmax: scores, running max and sum, ``acc_o += P K``."""
        T.clear(acc_s)
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        shared.softmax_step(acc_s, idx_s, base, m, m_prev, alpha, l, l_block)
        for i, j in T.Parallel(block_h, dim):
            acc_o[i, j] *= alpha[i]
        T.copy(acc_s, p_s)
        T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.prim_func
    def kernel(q: T.Tensor((rows, heads, dim), "bfloat16"), main: T.Tensor(main_shape, main_dtype),
               main_idx: T.Tensor((rows, main_keys), "int32"), extra: T.Tensor((extra_rows, 288), "uint8"),
               extra_idx: T.Tensor((rows, max(extra_keys, 1)), "int32"), sink: T.Tensor((heads,), "float"),
               out: T.Tensor(out_shape, out_dtype), lse: T.Tensor(lse_shape, "float")):
        with T.Kernel(rows, heads // block_h, splits, threads=threads) as (row, hb, split):
            q_s = T.alloc_shared((block_h, dim), "bfloat16")
            k_s = T.alloc_shared((block_k, dim), "bfloat16")
            p_s = T.alloc_shared((block_h, block_k), "bfloat16")
            raw = T.alloc_shared((block_k, ROW_BYTES["fp8"]), "uint8")
            main_idx_s = T.alloc_shared((list_sizes[0],), "int32", scope=list_scope)
            extra_idx_s = T.alloc_shared((list_sizes[1],), "int32", scope=list_scope)
            fp4_values = T.alloc_shared((16,), "float")
            acc_s = T.alloc_fragment((block_h, block_k), "float")
            acc_o = T.alloc_fragment((block_h, dim), "float")
            m = T.alloc_fragment((block_h,), "float")
            m_prev = T.alloc_fragment((block_h,), "float")
            alpha = T.alloc_fragment((block_h,), "float")
            l = T.alloc_fragment((block_h,), "float")
            l_block = T.alloc_fragment((block_h,), "float")
            gate = T.alloc_fragment((block_h,), "float")
            lse_row = T.alloc_fragment((block_h,), "float")

            T.copy(q[row, hb * block_h:(hb + 1) * block_h, :], q_s)
            shared.load_indices(main_idx, main_keys, main_rows, row, main_idx_s)
            if extra_keys:
                shared.load_indices(extra_idx, extra_keys, extra_rows, row, extra_idx_s)
            shared.fill_fp4_values(fp4_values)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NEG)
            # Split s takes the s-th equal slice of each list (the slices are padded with -1 to whole
            # blocks, so every loop has a static trip count). Gathers are plain copies, pipelined as
            # cp.async.
            for b in T.Pipelined(main_per_split, num_stages=num_stages):
                base = (split * main_per_split + b) * block_k
                shared.gather_main(main, main_idx_s, base, raw, k_s)
                attend(q_s, k_s, p_s, main_idx_s, base, acc_s, acc_o, m, m_prev, alpha, l, l_block)
            if extra_keys:
                for b in T.Pipelined(extra_per_split, num_stages=num_stages):
                    base = (split * extra_per_split + b) * block_k
                    shared.gather_extra(extra, extra_idx_s, base, raw, fp4_values, k_s)
                    attend(q_s, k_s, p_s, extra_idx_s, base, acc_s, acc_o, m, m_prev, alpha, l, l_block)
            shared.row_stats(m, l, sink, hb, lse_row, gate)
            for i, j in T.Parallel(block_h, dim):
                acc_o[i, j] *= gate[i]
            if splits == 1:
                T.copy(acc_o, out[row, hb * block_h:(hb + 1) * block_h, :])
                T.copy(lse_row, lse[row, hb * block_h:(hb + 1) * block_h])
            else:
                T.copy(acc_o, out[split, row, hb * block_h:(hb + 1) * block_h, :])
                T.copy(lse_row, lse[split, row, hb * block_h:(hb + 1) * block_h])

    return kernel


@tilelang.jit
def combine(heads: int, dim: int, splits: int, threads: int = 128):
    """Kernel merging ``sparse_mla`` partials ``(out_part f32 [splits, rows, heads, dim],
    lse_part f32 [splits, rows, heads], sink f32 [heads], out bf16 [rows, heads, dim],
    lse f32 [rows, heads])``: ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse)
    out_s * sigmoid(lse - sink)``."""
    rows = T.dynamic("rows")

    @T.prim_func
    def kernel(out_part: T.Tensor((splits, rows, heads, dim), "float"),
               lse_part: T.Tensor((splits, rows, heads), "float"), sink: T.Tensor((heads,), "float"),
               out: T.Tensor((rows, heads, dim), "bfloat16"), lse: T.Tensor((rows, heads), "float")):
        with T.Kernel(rows, heads, threads=threads) as (row, head):
            top = T.alloc_local((1,), "float")
            total = T.alloc_local((1,), "float")
            weight = T.alloc_local((1,), "float")
            acc = T.alloc_fragment((dim,), "float")
            top[0] = NEG
            for s in T.serial(splits):
                top[0] = T.max(top[0], lse_part[s, row, head])
            total[0] = 0.0
            T.fill(acc, 0)
            for s in T.serial(splits):
                weight[0] = T.exp2((lse_part[s, row, head] - top[0]) * LOG2E)
                total[0] += weight[0]
                for d in T.Parallel(dim):
                    acc[d] += weight[0] * out_part[s, row, head, d]
            lse_total = T.if_then_else(total[0] > 0, top[0] + T.log(total[0]), -T.infinity("float"))
            weight[0] = T.if_then_else(total[0] > 0, 1.0 / ((1.0 + T.exp(sink[head] - lse_total)) * total[0]), 0.0)
            for d in T.Parallel(dim):
                out[row, head, d] = T.cast(acc[d] * weight[0], "bfloat16")
            lse[row, head] = lse_total

    return kernel


def reference(q, keys, valid, sink, scale):
    """Torch math on gathered, decoded keys ``[rows, K, dim]`` (float32)."""
    from deepinfer.hal.ops.mla import sparse_attention

    return sparse_attention(q, keys, valid, sink, scale)


def main(rows: int = 64, heads: int = 64, main_keys: int = 128, extra_keys: int = 512, options=None) -> None:
    """Check one V4.1 decode shape (fp8 main + fp4 extra) against the HAL reference and time it,
    with the kernel ``options`` (a ``KernelOptions``; default: the backend's) pick."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.ops.mla import mla_sparse_decode
    from deepinfer_backends.sm100.options import DEFAULT
    from deepinfer_backends.sm100.wrappers import mla_sparse_decode as wrapper

    def run(**kwargs):
        return wrapper(**kwargs, options=options or DEFAULT)

    gen = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(rows, 1, heads, 512, generator=gen).to(torch.bfloat16),
                cache=_random_rows(gen, "fp8", 64 * 1024), indices=_random_indices(gen, rows, main_keys, 64 * 1024),
                extra_cache=_random_rows(gen, "fp4", 16 * 1024),
                extra_indices=_random_indices(gen, rows, extra_keys, 16 * 1024),
                sink=torch.randn(heads, generator=gen), scale=512 ** -0.5, cache_format="fp8", extra_format="fp4")
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got, want = run(**cuda), mla_sparse_decode(**args)
    torch.testing.assert_close(got[0].float().cpu(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: run(**cuda))
    moved = rows * (main_keys * ROW_BYTES["fp8"] + extra_keys * ROW_BYTES["fp4"])
    print(f"sparse_mla decode rows={rows} heads={heads} keys={main_keys}+{extra_keys}: {ms * 1e3:.1f} us, "
          f"{moved / ms / 1e6:.0f} GB/s")


def _random_rows(gen, fmt, count):
    from deepinfer.hal.formats import encode_tokens

    return encode_tokens(torch.randn(count, 512, generator=gen), fmt)


def _random_indices(gen, rows, keys, count):
    return torch.randint(0, count, (rows, 1, keys), generator=gen, dtype=torch.int32)


if __name__ == "__main__":
    main()

"""Sparse MLA decode on Blackwell's tcgen05 tensor cores (sm_100a): ``sparse_mla`` of
:mod:`mla_sparse_decode` (same kernel signature, same semantics, same :func:`combine` for split
partials) with both GEMMs on ``tcgen05.mma`` and their accumulators in tensor memory (TMEM).

The key lists are staged, gathered and decoded (fp8 528 B main rows, fp4 288 B extra rows, or bf16
rows) by the macros the Hopper kernel uses (:func:`mla_sparse_decode.shared_macros`), pipelined
the same way. Per key block of ``block_k`` keys and ``block_h = 64`` heads:

- ``S = Q K^T`` goes to a 64 x ``block_k`` float32 TMEM tile (TileLang picks the M=64 ``.ws``
  form: 32 columns), which the threads load, mask and feed to the same online softmax;
- ``P K`` runs as two MMAs of ``dim / 2`` columns each, into two 64 x 256 TMEM tiles (128 columns
  each), committed together; the threads fold them into the float32 running output in registers,
  ``acc = acc * alpha + P K``.

TMEM holds 32 + 128 + 128 = 288 of its 512 columns. The running output stays in registers, as on
Hopper, rather than accumulating in TMEM: the online softmax rescales it by ``alpha`` every block,
which for a TMEM-resident output means a full tcgen05.ld / scale / tcgen05.st round trip per block
(FlashAttention 4's correction warps) plus an ordering of that store before the next MMA; here
each block's product is loaded once and scaled in registers. ``P`` goes to the MMA through shared
memory (``p_s``), not TMEM. No warp specialisation yet: gather, decode, MMA and softmax phases
follow each other, as in the Hopper kernel.

Compiled for sm_100a but not run on Blackwell hardware. Hence the wrappers select it
only with ``backend.options.tcgen05=true`` on an sm_100a device (``toolchain.kernel_module``), and
``tests/backends/test_sm100_tcgen05.py`` only checks that it lowers to tcgen05/TMEM code that
nvcc and ptxas accept."""

import tilelang
import tilelang.language as T

from deepinfer_backends.sm100.kernels import mla_sparse_decode
from deepinfer_backends.sm100.kernels.mla_sparse_decode import _PASS_CONFIGS, NEG, ROW_BYTES, check_config


@tilelang.jit(pass_configs=_PASS_CONFIGS)
def sparse_mla(heads: int, dim: int, main_keys: int, extra_keys: int, scale: float, main_format: str = "fp8",
               splits: int = 1, block_h: int = 64, block_k: int = 64, num_stages: int = 2, threads: int = 256):
    """Kernel with the signature of :func:`mla_sparse_decode.sparse_mla` (``out``/``lse`` partials
    when ``splits > 1``). ``block_h`` must be 64 (the M of the tcgen05 MMAs) and ``dim`` 128, 256 or
    512: each half is one MMA of 64 to 256 columns (TileLang 0.1.15 finds no M=64 tcgen05 shape for
    a 32-column half, so dim 64 is refused)."""
    check_config(heads, dim, extra_keys, main_format, block_h)
    if block_h != 64 or dim not in (128, 256, 512) or threads % 128:
        raise ValueError(f"sparse_mla (tcgen05): block_h={block_h} must be 64, dim={dim} 128, 256 or 512, "
                         f"threads={threads} a multiple of 128; use mla_sparse_decode.sparse_mla otherwise")
    rows, main_rows, extra_rows = T.dynamic("rows"), T.dynamic("main_rows"), T.dynamic("extra_rows")
    main_shape = (main_rows, dim) if main_format == "bf16" else (main_rows, ROW_BYTES["fp8"])
    main_dtype = "bfloat16" if main_format == "bf16" else "uint8"
    out_shape, out_dtype = ((rows, heads, dim), "bfloat16") if splits == 1 else ((splits, rows, heads, dim), "float")
    lse_shape = (rows, heads) if splits == 1 else (splits, rows, heads)
    main_per_split, extra_per_split = -(-main_keys // (block_k * splits)), -(-extra_keys // (block_k * splits))
    half = dim // 2
    shared = mla_sparse_decode.shared_macros(block_h, block_k, dim, main_format, scale, splits)

    @T.macro
    def attend(q_s, k_s, p_s, idx_s, base, s_tmem, lo_tmem, hi_tmem, acc_s, product, acc_lo, acc_hi, m, m_prev,
               alpha, l, l_block, done):
        """One key block: ``S`` on tcgen05, the online softmax, ``acc = acc * alpha + P K`` with
        ``P K`` on tcgen05. ``done[0]`` / ``done[1]`` complete once per block (S, then P K)."""
        T.gemm(q_s, k_s, s_tmem, transpose_B=True, clear_accum=True, mbar=done[0])
        T.copy(s_tmem, acc_s)
        shared.softmax_step(acc_s, idx_s, base, m, m_prev, alpha, l, l_block)
        T.copy(acc_s, p_s)
        T.tcgen05_gemm(p_s, k_s[:, 0:half], lo_tmem, clear_accum=True, mbar=None)  # committed with the next one
        T.gemm(p_s, k_s[:, half:dim], hi_tmem, clear_accum=True, mbar=done[1])
        T.copy(lo_tmem, product)
        for i, j in T.Parallel(block_h, half):
            acc_lo[i, j] = acc_lo[i, j] * alpha[i] + product[i, j]
        T.copy(hi_tmem, product)
        for i, j in T.Parallel(block_h, half):
            acc_hi[i, j] = acc_hi[i, j] * alpha[i] + product[i, j]

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
            main_idx_s = T.alloc_shared((splits * main_per_split * block_k,), "int32")
            extra_idx_s = T.alloc_shared((max(splits * extra_per_split, 1) * block_k,), "int32")
            fp4_values = T.alloc_shared((16,), "float")
            s_tmem = T.alloc_tmem((block_h, block_k), "float")
            lo_tmem = T.alloc_tmem((block_h, half), "float")
            hi_tmem = T.alloc_tmem((block_h, half), "float")
            # one pair per loop: a synchronous tcgen05 GEMM waits on the parity of its own loop's counter
            main_done = T.alloc_barrier([1, 1])
            extra_done = T.alloc_barrier([1, 1])
            acc_s = T.alloc_fragment((block_h, block_k), "float")
            product = T.alloc_fragment((block_h, half), "float")
            acc_lo = T.alloc_fragment((block_h, half), "float")
            acc_hi = T.alloc_fragment((block_h, half), "float")
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
            T.fill(acc_lo, 0)
            T.fill(acc_hi, 0)
            T.fill(l, 0)
            T.fill(m, NEG)
            for b in T.Pipelined(main_per_split, num_stages=num_stages):
                base = (split * main_per_split + b) * block_k
                shared.gather_main(main, main_idx_s, base, raw, k_s)
                attend(q_s, k_s, p_s, main_idx_s, base, s_tmem, lo_tmem, hi_tmem, acc_s, product, acc_lo, acc_hi,
                       m, m_prev, alpha, l, l_block, main_done)
            if extra_keys:
                for b in T.Pipelined(extra_per_split, num_stages=num_stages):
                    base = (split * extra_per_split + b) * block_k
                    shared.gather_extra(extra, extra_idx_s, base, raw, fp4_values, k_s)
                    attend(q_s, k_s, p_s, extra_idx_s, base, s_tmem, lo_tmem, hi_tmem, acc_s, product, acc_lo,
                           acc_hi, m, m_prev, alpha, l, l_block, extra_done)
            # every warp has read its TMEM lanes before warp 0 frees the columns at the end
            T.tcgen05_before_thread_sync()
            T.sync_threads()
            shared.row_stats(m, l, sink, hb, lse_row, gate)
            for i, j in T.Parallel(block_h, half):
                acc_lo[i, j] *= gate[i]
                acc_hi[i, j] *= gate[i]
            if splits == 1:
                T.copy(acc_lo, out[row, hb * block_h:(hb + 1) * block_h, 0:half])
                T.copy(acc_hi, out[row, hb * block_h:(hb + 1) * block_h, half:dim])
                T.copy(lse_row, lse[row, hb * block_h:(hb + 1) * block_h])
            else:
                T.copy(acc_lo, out[split, row, hb * block_h:(hb + 1) * block_h, 0:half])
                T.copy(acc_hi, out[split, row, hb * block_h:(hb + 1) * block_h, half:dim])
                T.copy(lse_row, lse[split, row, hb * block_h:(hb + 1) * block_h])

    return kernel


def main() -> None:
    """:func:`mla_sparse_decode.main` (check against the HAL reference, time) with
    ``tcgen05=True``, so the wrapper runs this kernel; needs a Blackwell (sm_100a) GPU."""
    from deepinfer_backends.sm100.options import KernelOptions

    mla_sparse_decode.main(options=KernelOptions(tcgen05=True))


if __name__ == "__main__":
    main()

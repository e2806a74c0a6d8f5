"""Sparse MLA prefill on the ascend950 cube and vector cores: many query tokens, each attending
to its own ``topk`` rows of a bf16 latent buffer (the keys, also the values) with a per-head
sink. The plan is the decode kernel's
(:mod:`~deepinfer_backends.ascend950.kernels.mla_sparse_decode`), as the emulation gives both
one plan: a block per token and group of ``head_group`` heads, block ``b`` on AI core
``b % cores``; key tiles of ``key_tile`` gathered by the two vector cores, scored by the cube in
``d_split``-deep steps, an online softmax over each vector core's half of the heads, the
probabilities times the keys added to a float32 accumulator, one rounding at the end. The main
list (the first ``main_keys`` columns) and the extra list each arrive padded with -1 to whole
tiles (:func:`deepinfer_backends.ascend950.emulate.mla.padded_lists`), so the kernel's tiles are
the emulation's and a padding index gathers a zero row with a logit bias far below any score.
Buffers and their order: :func:`deepinfer_backends.ascend950.emulate.mla.buffers` with
``masked``."""
from .mla_sparse_decode import mla_sparse_decode_kernel


def mla_sparse_prefill_kernel(tokens: int, heads: int, dim: int, topk: int, main_keys: int, kv_rows: int,
                              head_group: int, key_tile: int, d_split: int, cores: int, scale: float, offsets: dict,
                              dtype: str = "bfloat16"):
    """The tilelang-ascend ``prim_func`` of ``out, lse = attend(q [tokens, heads, dim], kv [kv_rows,
    dim] at indices [tokens, topk], sink [heads])``, ``indices`` -1 where padded, the main list
    its first ``main_keys`` columns; ``offsets``: each buffer's byte offset in its scope by plan
    name."""
    if not 0 <= main_keys <= topk or main_keys % key_tile:
        raise ValueError(f"mla_sparse_prefill_kernel takes each index list padded to whole tiles of {key_tile}: "
                         f"main_keys={main_keys} of topk={topk} (pad with padded_lists)")
    func = mla_sparse_decode_kernel(tokens, heads, dim, topk, kv_rows, head_group, key_tile, d_split, cores, scale,
                                    offsets, dtype=dtype, cache_format="bf16", masked=True)
    return func.with_attr("global_symbol", "mla_sparse_prefill")

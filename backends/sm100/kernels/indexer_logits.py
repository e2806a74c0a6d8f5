"""Indexer logits on tensor cores: ``logits[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``.

Each CTA takes one token and ``block_keys`` keys: one GEMM of the token's heads ``[heads, dim]``
against the key tile ``[block_keys, dim]`` (float32 accumulation), ReLU, the per-head weights,
then the sum over heads. Keys past the end are read as zeros and never written. With
``queries_per_seq`` > 0 the keys are one list per sequence (``k [seqs, keys, dim]``) and token
``t`` reads the list of sequence ``t // queries_per_seq``, as a decode step lays them out."""
import tilelang
import tilelang.language as T
import torch


@tilelang.jit
def indexer_logits(heads: int, dim: int, block_keys: int = 128, threads: int = 128, queries_per_seq: int = 0,
                   weights_dtype: str = "float", weight_scale: float = 1.0):
    """Kernel ``(q bf16 [tokens, heads, dim], k bf16 [keys, dim] (or [seqs, keys, dim] with
    ``queries_per_seq``), weights [tokens, heads] (``weights_dtype``: float or bfloat16), logits f32
    [tokens, keys])``; ``tokens``, ``keys`` and ``seqs`` are dynamic. ``heads`` a multiple of 64 and
    ``dim`` of 32 (the wrapper pads with zeros). Each weight is read as float32 and multiplied by
    ``weight_scale`` (a float32 constant) where that is not 1."""
    tokens = T.dynamic("tokens")
    keys = T.dynamic("keys")
    seqs = T.dynamic("seqs")
    key_shape = (seqs, keys, dim) if queries_per_seq else (keys, dim)

    @T.prim_func
    def kernel(q: T.Tensor((tokens, heads, dim), "bfloat16"), k: T.Tensor(key_shape, "bfloat16"),
               weights: T.Tensor((tokens, heads), weights_dtype), logits: T.Tensor((tokens, keys), "float")):
        with T.Kernel(T.ceildiv(keys, block_keys), tokens, threads=threads) as (kb, t):
            q_tile = T.alloc_shared((heads, dim), "bfloat16")
            k_tile = T.alloc_shared((block_keys, dim), "bfloat16")
            scores = T.alloc_fragment((heads, block_keys), "float")
            total = T.alloc_fragment((block_keys,), "float")
            T.copy(q[t, 0:heads, 0:dim], q_tile)
            if queries_per_seq:
                T.copy(k[t // queries_per_seq, kb * block_keys:(kb + 1) * block_keys, 0:dim], k_tile)
            else:
                T.copy(k[kb * block_keys:(kb + 1) * block_keys, 0:dim], k_tile)
            T.clear(scores)
            T.gemm(q_tile, k_tile, scores, transpose_B=True)
            for h, j in T.Parallel(heads, block_keys):
                if weight_scale == 1.0:
                    scores[h, j] = T.max(scores[h, j], 0.0) * T.Cast("float32", weights[t, h])
                else:
                    scores[h, j] = T.max(scores[h, j], 0.0) * (T.Cast("float32", weights[t, h]) *
                                                                T.float32(weight_scale))
            T.reduce_sum(scores, total, dim=0)
            for j in T.Parallel(block_keys):
                if kb * block_keys + j < keys:
                    logits[t, kb * block_keys + j] = total[j]

    return kernel


def main(tokens: int = 4096, heads: int = 64, dim: int = 128, keys: int = 16384) -> None:
    """Check against the HAL reference and time on the current GPU."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.ops.indexer import indexer_logits as reference
    from deepinfer_backends.sm100.wrappers import indexer_logits as run

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(keys, dim, generator=gen).to("cuda", torch.bfloat16)
    w = (heads ** -0.5 * torch.randn(tokens, heads, generator=gen)).cuda()
    torch.testing.assert_close(run(q, k, w), reference(q, k, w), atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: run(q, k, w))
    print(f"indexer_logits tokens={tokens} heads={heads} dim={dim} keys={keys}: {ms:.3f} ms, "
          f"{2 * tokens * heads * dim * keys / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()

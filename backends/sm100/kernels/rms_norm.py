"""RMSNorm over the last dim, optionally fused with the residual add, computed in float32.

Each CTA normalises ``block_rows`` rows held in registers: with a residual it writes
``s = x + residual`` (the new residual stream, rounded to the residual's dtype) and
``rms_norm(s) * weight`` of that rounded sum (in ``x``'s dtype) in one pass over memory."""
import tilelang
import tilelang.language as T
import torch

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float32: "float"}


@tilelang.jit
def rms_norm(dim: int, eps: float, dtype: str = "bfloat16", residual_dtype: str | None = None,
             block_rows: int = 1, threads: int = 128):
    """Kernel ``(x [rows, dim], weight f32 [dim], out [rows, dim])``, or with ``residual_dtype``
    ``(x, residual, weight, out, residual_out)``; ``rows`` is dynamic."""
    rows = T.dynamic("rows")

    @T.macro
    def normalize(summed, weight, out, first):
        squares = T.alloc_fragment((block_rows, dim), "float")
        total = T.alloc_fragment((block_rows,), "float")
        for i, j in T.Parallel(block_rows, dim):
            squares[i, j] = summed[i, j] * summed[i, j]
        T.reduce_sum(squares, total, dim=1)
        for i in T.Parallel(block_rows):
            total[i] = T.rsqrt(total[i] / dim + eps)
        for i, j in T.Parallel(block_rows, dim):
            if first + i < rows:
                out[first + i, j] = T.cast(summed[i, j] * total[i] * weight[j], dtype)

    if residual_dtype is None:
        @T.prim_func
        def kernel(x: T.Tensor((rows, dim), dtype), weight: T.Tensor((dim,), "float"),
                   out: T.Tensor((rows, dim), dtype)):
            with T.Kernel(T.ceildiv(rows, block_rows), threads=threads) as block:
                summed = T.alloc_fragment((block_rows, dim), "float")
                for i, j in T.Parallel(block_rows, dim):
                    summed[i, j] = T.if_then_else(block * block_rows + i < rows,
                                                  T.cast(x[block * block_rows + i, j], "float"), 0.0)
                normalize(summed, weight, out, block * block_rows)
    else:
        @T.prim_func
        def kernel(x: T.Tensor((rows, dim), dtype), residual: T.Tensor((rows, dim), residual_dtype),
                   weight: T.Tensor((dim,), "float"), out: T.Tensor((rows, dim), dtype),
                   residual_out: T.Tensor((rows, dim), residual_dtype)):
            with T.Kernel(T.ceildiv(rows, block_rows), threads=threads) as block:
                summed = T.alloc_fragment((block_rows, dim), "float")
                for i, j in T.Parallel(block_rows, dim):
                    summed[i, j] = T.if_then_else(
                        block * block_rows + i < rows,
                        T.cast(T.cast(T.cast(x[block * block_rows + i, j], "float")
                                      + T.cast(residual[block * block_rows + i, j], "float"), residual_dtype),
                               "float"), 0.0)
                for i, j in T.Parallel(block_rows, dim):
                    if block * block_rows + i < rows:
                        residual_out[block * block_rows + i, j] = T.cast(summed[i, j], residual_dtype)
                normalize(summed, weight, out, block * block_rows)

    return kernel


def tl_dtype(dtype: torch.dtype) -> str:
    """TileLang name of a torch activation dtype this kernel takes."""
    if dtype not in _TORCH_TO_TL:
        raise ValueError(f"rms_norm kernel takes {sorted(map(str, _TORCH_TO_TL))} activations, got {dtype}")
    return _TORCH_TO_TL[dtype]


def main(rows: int = 4096, dim: int = 4096) -> None:
    """Check the fused residual variant against the HAL reference and time it."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.ops.norm import rms_norm as reference
    from deepinfer_backends.sm100.wrappers import rms_norm as run

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).cuda()
    got, want = run(x, weight, 1e-6, residual), reference(x, weight, 1e-6, residual)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: run(x, weight, 1e-6, residual))
    print(f"rms_norm+residual rows={rows} dim={dim}: {ms * 1e3:.1f} us, {4 * x.numel() * 2 / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()

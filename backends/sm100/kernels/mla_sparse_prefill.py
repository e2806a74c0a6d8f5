"""Sparse MLA prefill: bf16 keys gathered from a key buffer by per-token index lists.

The kernel is :func:`~deepinfer_backends.sm100.kernels.mla_sparse_decode.sparse_mla` with
``main_format="bf16"`` and no extra list (one kernel serves both ops); this module checks and
times it on prefill shapes."""
import torch

from deepinfer_backends.sm100.kernels.mla_sparse_decode import sparse_mla  # noqa: F401  (the kernel)


def main(tokens: int = 1024, heads: int = 64, keys: int = 640, kv_rows: int = 1 << 16) -> None:
    """Check one V4.1 prefill shape against the HAL reference and time it."""
    from tilelang.profiler import do_bench

    from deepinfer.hal.ops.mla import mla_sparse_prefill as reference
    from deepinfer_backends.sm100.wrappers import mla_sparse_prefill as run

    gen = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16),
                kv=torch.randn(kv_rows, 512, generator=gen).to(torch.bfloat16),
                indices=torch.randint(0, kv_rows, (tokens, keys), generator=gen, dtype=torch.int32),
                sink=torch.randn(heads, generator=gen), scale=512 ** -0.5)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got, want = run(**cuda), reference(**args)
    torch.testing.assert_close(got[0].float().cpu(), want[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: run(**cuda))
    print(f"sparse_mla prefill tokens={tokens} heads={heads} keys={keys}: {ms * 1e3:.1f} us, "
          f"{4 * tokens * heads * keys * 512 / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()

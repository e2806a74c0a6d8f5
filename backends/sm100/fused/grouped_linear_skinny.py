"""The bf16 ``grouped_linear`` of a few rows in one Triton kernel, ``y[t, g] = x[t, g] @ w[g].T``:
each program takes ``BLOCK_N`` output columns of one group and streams that slice of the group's
weight through shared memory in ``BLOCK_K`` steps, float32 accumulation, a bf16 store. With
``HEAD`` the input's heads (``HEAD`` wide along each group's ``K``) have their trailing ``ROPE``
dims turned back by RoPE as they are loaded (the attention output's inverse rotation ahead of the
grouped output projection), rounded to bf16 as ``apply_rope`` would store them.

With a handful of rows the projection reads each group's weight once and is bound by memory; the
tiles depend only on the shapes, never on the row count up to :data:`BLOCK_T`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
"""Rows a program holds; a call takes this kernel up to this many rows."""
BLOCK_N = 32
BLOCK_K = 256
NUM_STAGES = 4


@triton.jit
def grouped_linear_skinny_kernel(x, w, y, rows, n, k, x_stride, y_stride, positions, cos_sin, table_stride, sign,
                                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 NUM_STAGES: tl.constexpr, HEAD: tl.constexpr, ROPE: tl.constexpr):
    """Group ``pid0 // (n / BLOCK_N)``, its columns ``BLOCK_N * (pid0 % (n / BLOCK_N)) ..`` and rows
    ``[BLOCK_T * pid1, ..)`` of ``y [rows, groups, n]`` (rows ``y_stride`` apart) for
    ``x [rows, groups, k]`` (rows ``x_stride`` apart, groups ``k`` apart) and ``w [groups, n, k]``. With ``HEAD`` > 0 every
    ``HEAD``-wide head of ``x`` along ``k`` has its trailing ``ROPE`` dims turned in interleaved
    pairs by ``sign`` times the angle of row ``positions[t]`` of ``cos_sin`` (cos then sin,
    ``table_stride`` apart) before the product."""
    tiles = n // BLOCK_N
    group = tl.program_id(0) // tiles
    col = (tl.program_id(0) % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = row < rows
    depth = tl.arange(0, BLOCK_K)
    x_rows = x + row[:, None].to(tl.int64) * x_stride + group.to(tl.int64) * k
    w_rows = w + (group.to(tl.int64) * n + col[:, None]) * k
    if HEAD:
        angle_rows = cos_sin + tl.load(positions + row, mask=live, other=0)[:, None].to(tl.int64) * table_stride
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    for step in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        kk = step + depth
        within = kk < k
        a = tl.load(x_rows + kk[None, :], mask=live[:, None] & within[None, :], other=0.0)
        if HEAD:
            even, odd = tl.split(tl.reshape(a.to(tl.float32), (BLOCK_T, BLOCK_K // 2, 2)))
            place = (step + 2 * tl.arange(0, BLOCK_K // 2)) % HEAD
            inside = (step + 2 * tl.arange(0, BLOCK_K // 2)) < k
            turning = live[:, None] & ((place >= HEAD - ROPE) & inside)[None, :]
            angle = angle_rows + ((place - (HEAD - ROPE)) // 2)[None, :]
            cos = tl.load(angle, mask=turning, other=1.0)
            sin = sign * tl.load(angle + ROPE // 2, mask=turning, other=0.0)
            turned = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), (BLOCK_T, BLOCK_K))
            a = turned.to(x.dtype.element_ty)
        b = tl.load(w_rows + kk[None, :], mask=within[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    out = y + row[:, None].to(tl.int64) * y_stride + group * n + col[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=live[:, None])


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x [T, G, K]`` and ``weight [G, N, K]``: bf16, at most
    :data:`BLOCK_T` rows, ``N`` a multiple of :data:`BLOCK_N`, unit stride along ``K``."""
    return (x.dtype == weight.dtype == torch.bfloat16 and 0 < x.shape[0] <= BLOCK_T
            and weight.shape[1] % BLOCK_N == 0 and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def grouped_linear_skinny(x: torch.Tensor, weight: torch.Tensor,
                          rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None = None) -> torch.Tensor:
    """``y [T, G, N]`` of :func:`grouped_linear_skinny_kernel` for ``x [T, G, K]`` and contiguous
    ``weight [G, N, K]`` where :func:`serves` holds; ``rope``: ``(positions int64 [T], cos_sin
    float32 [P, R], head width, conjugate)`` turns ``x``'s heads first (the HAL ``grouped_linear``'s
    RoPE)."""
    tokens, groups, k = x.shape
    n = weight.shape[1]
    y = torch.empty(tokens, groups, n, dtype=x.dtype, device=x.device)
    positions, table, head, conjugate = rope if rope is not None else (y, y, 0, False)
    grouped_linear_skinny_kernel[(groups * (n // BLOCK_N), -(-tokens // BLOCK_T))](
        x, weight, y, tokens, n, k, x.stride(0), y.stride(0), positions, table, table.stride(0), -1.0 if conjugate else 1.0,
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, HEAD=head,
        ROPE=table.shape[1] if rope is not None else 0, num_warps=4)
    return y


def main() -> None:
    """Check the kernel against the HAL reference (with and without the inverse RoPE) on this GPU."""
    from deepinfer.hal.ops.grouped_linear import grouped_linear
    from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq

    gen = torch.Generator().manual_seed(0)
    table = rope_cos_sin(rope_inv_freq(10000.0), 4096)
    for tokens, groups, n, k in ((1, 8, 512, 4096), (16, 8, 512, 4096), (5, 3, 64, 1024)):
        x = torch.randn(tokens, groups, k, generator=gen).to(torch.bfloat16)
        w = (torch.randn(groups, n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        for rope in (None, (positions, table, 512, True)):
            got = grouped_linear_skinny(x.cuda(), w.cuda(), None if rope is None else (
                positions.cuda(), table.cuda(), 512, True))
            want = grouped_linear(x, w) if rope is None else grouped_linear(x, w, positions, table, 512, True)
            error = (got.cpu().double() - want.double()).abs().max().item()
            assert error <= 2 ** -7 * want.double().abs().max().item(), f"{tokens}x{groups}x{n}x{k}: {error}"
            print(f"grouped_linear_skinny: {tokens} tokens, {groups} groups, {n}x{k}, rope {rope is not None}: ok")


if __name__ == "__main__":
    main()

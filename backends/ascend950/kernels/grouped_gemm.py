"""Grouped GEMM (bf16 or float32 operands) on the ascend950 cube and vector cores. Every expert's
segment of ``segment_rows`` rows (callers pad segments to whole tiles) is cut into output
tiles of ``base_m x base_n``, enumerated expert by expert, row tile by row tile, column tile by
column tile; tile ``t`` runs on AI core ``t % cores``. The cube stages ``stages`` K steps of
``base_k`` of both operands in L1 (double-buffered by chunk parity), moves each step into L0A and
L0B (double-buffered by step parity) and accumulates in float32 in L0C; the finished tile goes to
the core's GM workspace slot. Its two vector cores, woken by a cross-core flag, each take half
the tile's rows, round them once to the output dtype in UB and store them, then flag the cube
that the slot is free. Buffers, in the plan's order (``GemmTiles.buffers``): ``a_l1``, ``b_l1``,
``a_l0``, ``b_l0``, ``acc``, ``acc_ub``, ``out_ub``."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects


def grouped_gemm_kernel(experts: int, segment_rows: int, n: int, k: int, base_m: int, base_n: int,
                        base_k: int, stages: int, cores: int, offsets: dict, dtype: str = "bfloat16"):
    """The tilelang-ascend ``prim_func`` of ``out[rows of expert e] = x[rows of e] @ weight[e].T``
    for ``experts`` segments of ``segment_rows`` rows; ``weight`` is ``[experts, n, k]``;
    ``offsets``: each on-chip buffer's byte offset in its scope by plan name."""
    import tilelang.language as T

    for name, size, tile in (("segment_rows", segment_rows, base_m), ("n", n, base_n), ("k", k, base_k * stages)):
        if size % tile:
            raise ValueError(f"grouped_gemm_kernel takes whole tiles: {name}={size} is not a multiple of {tile}")
    tiles_m, tiles_n = segment_rows // base_m, n // base_n
    tiles = experts * tiles_m * tiles_n
    rounds = -(-tiles // cores)
    chunks = k // (base_k * stages)
    half = base_m // 2
    rows = experts * segment_rows
    accum = "float32"

    @T.prim_func
    def grouped_gemm(x: T.Tensor((rows, k), dtype), weight: T.Tensor((experts, n, k), dtype),
                     workspace: T.Tensor((cores, 2, base_m, base_n), accum), out: T.Tensor((rows, n), dtype)):
        with T.Kernel(cores, is_npu=True) as (core, sub):
            a_l1 = T.alloc_L1((2, stages, base_m, base_k), dtype)
            b_l1 = T.alloc_L1((2, stages, base_n, base_k), dtype)
            a_l0 = T.alloc_L0A((2, base_m, base_k), dtype)
            b_l0 = T.alloc_L0B((2, base_k, base_n), dtype)
            acc = T.alloc_L0C((base_m, base_n), accum)
            acc_ub = T.alloc_ub((half, base_n), accum)
            out_ub = T.alloc_ub((2, half, base_n), dtype)
            T.annotate_address({a_l1: offsets["a_l1"], b_l1: offsets["b_l1"], a_l0: offsets["a_l0"],
                                b_l0: offsets["b_l0"], acc: offsets["acc"], acc_ub: offsets["acc_ub"],
                                out_ub: offsets["out_ub"]})
            with T.Scope("C"):
                for step in T.serial(rounds):
                    tile = step * cores + core
                    if tile < tiles:
                        expert = tile // (tiles_m * tiles_n)
                        m0 = expert * segment_rows + (tile // tiles_n) % tiles_m * base_m
                        n0 = tile % tiles_n * base_n
                        for chunk in T.serial(chunks):
                            for s in T.serial(stages):
                                k0 = (chunk * stages + s) * base_k
                                T.copy(x[m0:m0 + base_m, k0:k0 + base_k], a_l1[chunk % 2, s, :, :])
                                T.copy(weight[expert, n0:n0 + base_n, k0:k0 + base_k], b_l1[chunk % 2, s, :, :])
                            T.barrier_all()
                            for s in T.serial(stages):
                                T.copy(a_l1[chunk % 2, s, :, :], a_l0[s % 2, :, :])
                                T.copy(b_l1[chunk % 2, s, :, :], b_l0[s % 2, :, :], transpose=True)
                                T.barrier_all()
                                T.mma(a_l0[s % 2, :, :], b_l0[s % 2, :, :], acc, init=(chunk * stages + s == 0))
                                T.barrier_all()
                        if step > 0:
                            T.wait_cross_flag(1)
                        T.copy(acc, workspace[core, step % 2, :, :])
                        T.set_cross_flag("FIX", 0)
            with T.Scope("V"):
                for step in T.serial(rounds):
                    tile = step * cores + core
                    if tile < tiles:
                        expert = tile // (tiles_m * tiles_n)
                        m0 = expert * segment_rows + (tile // tiles_n) % tiles_m * base_m + sub * half
                        n0 = tile % tiles_n * base_n
                        T.wait_cross_flag(0)
                        T.copy(workspace[core, step % 2, sub * half:(sub + 1) * half, :], acc_ub)
                        T.barrier_all()
                        T.tile.cast(out_ub[step % 2, :, :], acc_ub, "CAST_RINT", half * base_n)
                        T.barrier_all()
                        T.copy(out_ub[step % 2, :, :], out[m0:m0 + half, n0:n0 + base_n])
                        T.set_cross_flag("MTE3", 1)

    return grouped_gemm

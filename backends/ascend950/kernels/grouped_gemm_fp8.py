"""FP8 x FP8 grouped GEMM (A5) on the ascend950 cube and vector cores, with UE8M0 scales per 32
values along K packed two per int16 (low byte first). Tiles and their spread over the AI cores
are the bf16 kernel's (:mod:`~deepinfer_backends.ascend950.kernels.grouped_gemm`). The cube
stages ``stages`` K steps of ``base_k`` e4m3 values in L1 and multiplies them one 32-deep scale
block at a time (L0A/L0B double-buffered by block parity) into L0C, handing each block's float32
partial sum to the core's GM slot. Each vector core takes its half of the rows, unpacks the
block's scales from the int16 pairs into UB (a column of its rows' scales, a row of the weight
rows' scales, each byte ``e`` written as the bits of the float ``2^(e - 127)`` through an int32
view of the float buffer; ``e = 0`` gives 0, not ``2^-127``), scales the partial by both,
adds it to its float32 accumulator, and
stores the float32 tile once the K walk ends. Buffers: ``GemmTiles.fp8_buffers``."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects

SCALE_BLOCK = 32


def ue8m0_bits(T, packed, row, block):
    """The float32 bits of ``2^(e - 127)`` for scale byte ``block`` of row ``row`` of UE8M0 scales
    packed two per int16 (low byte first), ``T`` being ``tilelang.language``: ``e`` in the
    exponent field (a scalar reinterpret would not compile, so the bits go to an int32 view of a
    float buffer; ``e = 0`` gives 0)."""
    word = T.Cast("int32", packed[row, block // 2]) & 0xFFFF
    return T.shift_left(T.shift_right(word, (block % 2) * 8) & 0xFF, 23)


def grouped_gemm_fp8_kernel(experts: int, segment_rows: int, n: int, k: int, base_m: int, base_n: int,
                            base_k: int, stages: int, cores: int, offsets: dict):
    """The tilelang-ascend ``prim_func`` of ``out[rows of e] = (x * x_scale)[rows of e] @
    (weight[e] * weight_scale[e]).T`` in float32, operands e4m3, scales UE8M0 packed two per int16
    (``x_scale [rows, k / 64]``, ``weight_scale [experts, n, k / 64]``); ``offsets``: each
    buffer's byte offset in its scope by plan name."""
    import tilelang.language as T

    for name, size, tile in (("segment_rows", segment_rows, base_m), ("n", n, base_n), ("k", k, base_k * stages),
                             ("base_k", base_k, SCALE_BLOCK)):
        if size % tile:
            raise ValueError(f"grouped_gemm_fp8_kernel takes whole tiles: {name}={size} is not a multiple of {tile}")
    tiles_m, tiles_n = segment_rows // base_m, n // base_n
    tiles = experts * tiles_m * tiles_n
    rounds = -(-tiles // cores)
    chunks = k // (base_k * stages)
    per_step = base_k // SCALE_BLOCK
    blocks = k // SCALE_BLOCK
    half = base_m // 2
    rows = experts * segment_rows
    fp8, accum = "e4m3_float8", "float32"

    @T.prim_func
    def grouped_gemm_fp8(x: T.Tensor((rows, k), fp8), x_scale: T.Tensor((rows, k // 64), "int16"),
                         weight: T.Tensor((experts, n, k), fp8),
                         weight_scale: T.Tensor((experts, n, k // 64), "int16"),
                         workspace: T.Tensor((cores, base_m, base_n), accum), out: T.Tensor((rows, n), accum)):
        with T.Kernel(cores, is_npu=True) as (core, sub):
            a_l1 = T.alloc_L1((2, stages, base_m, base_k), fp8)
            b_l1 = T.alloc_L1((2, stages, base_n, base_k), fp8)
            a_l0 = T.alloc_L0A((2, base_m, SCALE_BLOCK), fp8)
            b_l0 = T.alloc_L0B((2, SCALE_BLOCK, base_n), fp8)
            acc = T.alloc_L0C((base_m, base_n), accum)
            acc_ub = T.alloc_ub((half, base_n), accum)
            partial = T.alloc_ub((half, base_n), accum)
            a_scales = T.alloc_ub((half, k // 64), "int16")
            b_scales = T.alloc_ub((base_n, k // 64), "int16")
            b_row = T.alloc_ub((base_n,), accum)
            a_row = T.alloc_ub((half,), accum)
            b_bits = T.alloc_ub((base_n,), "int32")
            a_bits = T.alloc_ub((half,), "int32")
            T.annotate_address({a_l1: offsets["a_l1"], b_l1: offsets["b_l1"], a_l0: offsets["a_l0"],
                                b_l0: offsets["b_l0"], acc: offsets["acc"], acc_ub: offsets["acc_ub"],
                                partial: offsets["partial"], a_scales: offsets["a_scales"],
                                b_scales: offsets["b_scales"], b_row: offsets["b_row"], a_row: offsets["a_row"],
                                b_bits: offsets["b_row"], a_bits: offsets["a_row"]})
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
                                for j in T.serial(per_step):
                                    kb = j * SCALE_BLOCK
                                    T.copy(a_l1[chunk % 2, s, :, kb:kb + SCALE_BLOCK], a_l0[j % 2, :, :])
                                    T.copy(b_l1[chunk % 2, s, :, kb:kb + SCALE_BLOCK], b_l0[j % 2, :, :],
                                           transpose=True)
                                    T.barrier_all()
                                    T.mma(a_l0[j % 2, :, :], b_l0[j % 2, :, :], acc, init=True)
                                    T.barrier_all()
                                    T.copy(acc, workspace[core, :, :])
                                    T.set_cross_flag("FIX", 0)
                                    T.wait_cross_flag(1)
            with T.Scope("V"):
                for step in T.serial(rounds):
                    tile = step * cores + core
                    if tile < tiles:
                        expert = tile // (tiles_m * tiles_n)
                        m0 = expert * segment_rows + (tile // tiles_n) % tiles_m * base_m + sub * half
                        n0 = tile % tiles_n * base_n
                        T.tile.fill(acc_ub, 0.0)
                        T.copy(x_scale[m0:m0 + half, :], a_scales)
                        T.copy(weight_scale[expert, n0:n0 + base_n, :], b_scales)
                        T.barrier_all()
                        for block in T.serial(blocks):
                            for c in T.serial(base_n):
                                b_bits[c] = ue8m0_bits(T, b_scales, c, block)
                            for r in T.serial(half):
                                a_bits[r] = ue8m0_bits(T, a_scales, r, block)
                            T.barrier_all()
                            T.wait_cross_flag(0)
                            T.copy(workspace[core, sub * half:(sub + 1) * half, :], partial)
                            T.barrier_all()
                            T.set_cross_flag("MTE2", 1)
                            T.tile.row_expand_mul(partial, partial, a_row)
                            for r in T.serial(half):
                                T.tile.mul(partial[r, :], partial[r, :], b_row)
                            T.tile.add(acc_ub, acc_ub, partial)
                            T.barrier_all()
                        T.copy(acc_ub, out[m0:m0 + half, n0:n0 + base_n])

    return grouped_gemm_fp8

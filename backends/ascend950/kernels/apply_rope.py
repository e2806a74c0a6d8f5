"""RoPE on the ascend950 vector cores, in place on the trailing ``rope_dim`` columns of ``rows``
rows (``tokens`` tokens of ``heads`` consecutive rows each; the other columns are not touched), in
tiles of ``tile_rows`` rows, tile ``t`` run by vector core ``t % vector_cores``. A tile's rotated
columns are copied into UB (double-buffered by tile parity), each row's ``cos_sin`` row is
copied in by its token's position, and the tile turns in float32: ``x * cos + partner * sin``,
where ``partner`` swaps each interleaved pair, ``cos`` repeats each pair's cosine and ``sin``
holds its sine with the sign of its place in the pair (``-sin``, ``+sin``; swapped to
conjugate). The three come from UB gathers at byte offsets built once a launch; the result is
rounded once into the input's slot and copied back. Buffers, in the plan's order
(:func:`deepinfer_backends.ascend950.emulate.apply_rope.plan_buffers`): ``rope_in``, then
``rope``, ``partner``, ``cos``, ``sin``, ``table``, the three gathers' offsets and ``sign``; the
gathers' scratch follows them."""
# no `from __future__ import annotations`: TVMScript reads the parameter annotations as objects


def rope_macros(T, tile_rows: int, rope_dim: int, conjugate: bool):
    """The tile code both RoPE kernels share, as TVMScript macros over the buffers of
    :func:`deepinfer_backends.ascend950.emulate.apply_rope.rope_buffers`: ``build_offsets``
    fills the gathers' byte offsets and the pair signs (once a launch); ``rotate`` turns ``rope``
    by the angles in ``table`` (the tile's ``cos_sin`` rows); ``restore_offsets`` undoes what the
    gathers' lowering does to their offsets (a right shift by 2, in place, making element indices
    of them)."""
    half = rope_dim // 2
    flip = -1 if conjugate else 1

    @T.macro
    def build_offsets(swap_offsets, cos_offsets, sin_offsets, sign):
        for r in T.serial(tile_rows):
            for c in T.serial(rope_dim):
                swap_offsets[r, c] = T.Cast("uint32", (r * rope_dim + c + 1 - c % 2 * 2) * 4)
                cos_offsets[r, c] = T.Cast("uint32", (r * rope_dim + c // 2) * 4)
                sin_offsets[r, c] = T.Cast("uint32", (r * rope_dim + half + c // 2) * 4)
                sign[r, c] = T.Cast("float32", (c % 2 * 2 - 1) * flip)

    @T.macro
    def rotate(rope, partner, cos, sin, table, swap_offsets, cos_offsets, sin_offsets, sign):
        T.tile.gather(partner, rope, swap_offsets, 0)
        T.tile.gather(cos, table, cos_offsets, 0)
        T.tile.gather(sin, table, sin_offsets, 0)
        T.tile.mul(sin, sin, sign)
        T.tile.mul(rope, rope, cos)
        T.tile.mul(partner, partner, sin)
        T.tile.add(rope, rope, partner)

    @T.macro
    def restore_offsets(swap_offsets, cos_offsets, sin_offsets):
        T.tile.bitwise_lshift(swap_offsets, swap_offsets, 2)
        T.tile.bitwise_lshift(cos_offsets, cos_offsets, 2)
        T.tile.bitwise_lshift(sin_offsets, sin_offsets, 2)

    return build_offsets, rotate, restore_offsets


def apply_rope_kernel(tokens: int, heads: int, dim: int, rope_dim: int, table_rows: int, tile_rows: int,
                      vector_cores: int, offsets: dict, conjugate: bool = False, dtype: str = "bfloat16"):
    """The tilelang-ascend ``prim_func`` rotating ``x [tokens * heads, dim]`` (bf16 or fp16) in
    place by ``cos_sin [table_rows, rope_dim]`` (float32) at ``positions [tokens]`` (int32);
    ``tokens * heads`` a multiple of ``tile_rows`` (callers pad the last tile); ``offsets``: each
    UB buffer's byte offset by its plan name, as
    :func:`deepinfer_backends.ascend950.buffers.layout` places them."""
    import tilelang.language as T

    rows = tokens * heads
    if rows % tile_rows:
        raise ValueError(f"apply_rope_kernel takes whole tiles: rows={rows} is not a multiple of tile_rows={tile_rows}")
    if vector_cores % 2:
        raise ValueError(f"vector_cores={vector_cores}: an AI core pairs two vector cores")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"apply_rope_kernel rotates bfloat16 or float16 rows, got {dtype}")
    tiles = rows // tile_rows
    rounds = -(-tiles // vector_cores)
    count = tile_rows * rope_dim
    build_offsets, rotate, restore_offsets = rope_macros(T, tile_rows, rope_dim, conjugate)

    @T.prim_func
    def apply_rope(x: T.Tensor((rows, dim), dtype), positions: T.Tensor((tokens,), "int32"),
                   cos_sin: T.Tensor((table_rows, rope_dim), "float32")):
        with T.Kernel(vector_cores // 2, is_npu=True) as (block, sub):
            rope_in = T.alloc_ub((2, tile_rows, rope_dim), dtype)
            rope = T.alloc_ub((tile_rows, rope_dim), "float32")
            partner = T.alloc_ub((tile_rows, rope_dim), "float32")
            cos = T.alloc_ub((tile_rows, rope_dim), "float32")
            sin = T.alloc_ub((tile_rows, rope_dim), "float32")
            table = T.alloc_ub((tile_rows, rope_dim), "float32")
            swap_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            cos_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            sin_offsets = T.alloc_ub((tile_rows, rope_dim), "uint32")
            sign = T.alloc_ub((tile_rows, rope_dim), "float32")
            T.annotate_address({rope_in: offsets["rope_in"], rope: offsets["rope"], partner: offsets["partner"],
                                cos: offsets["cos"], sin: offsets["sin"], table: offsets["table"],
                                swap_offsets: offsets["swap_offsets"], cos_offsets: offsets["cos_offsets"],
                                sin_offsets: offsets["sin_offsets"], sign: offsets["sign"]})
            with T.Scope("V"):
                build_offsets(swap_offsets, cos_offsets, sin_offsets, sign)
                for step in T.serial(rounds):
                    tile = step * vector_cores + block * 2 + sub
                    slot = step % 2
                    if tile < tiles:
                        first = tile * tile_rows
                        T.copy(x[first:first + tile_rows, dim - rope_dim:dim], rope_in[slot, :, :])
                        for r in T.serial(tile_rows):
                            T.copy(cos_sin[positions[(first + r) // heads], :], table[r, :])
                        T.barrier_all()
                        T.tile.cast(rope, rope_in[slot, :, :], "CAST_NONE", count)
                        rotate(rope, partner, cos, sin, table, swap_offsets, cos_offsets, sin_offsets, sign)
                        T.tile.cast(rope_in[slot, :, :], rope, "CAST_RINT", count)
                        restore_offsets(swap_offsets, cos_offsets, sin_offsets)
                        T.barrier_all()
                        T.copy(rope_in[slot, :, :], x[first:first + tile_rows, dim - rope_dim:dim])

    return apply_rope

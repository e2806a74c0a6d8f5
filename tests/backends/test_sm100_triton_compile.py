"""Every sm100 Triton kernel compiles for sm_90 (Hopper) to a cubin on this machine, no GPU
needed: Triton's front end, its GPU passes and the ptxas it ships. Catches what the interpreter
lets through (globals that are not constexpr, ops without a GPU lowering)."""
import importlib.util
import itertools

import pytest

from tests.backends.triton_cubin import hopper_cubin

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _kernels():
    from deepinfer_backends.sm100.fused import (align_fp8, ep_combine, grouped_gemm_skinny, kv_load, linear_skinny,
                                                mhc_mixes, mhc_streams, mxfp4_cast, quantize_activations, rope, swiglu,
                                                tile_schedule)

    for x, fn, parts in (("*bf16", "*bf16", 3), ("*fp32", "*fp32", 1)):
        yield f"mhc_mix_partials[{parts} parts]", mhc_mixes.mhc_mix_partials, dict(
            x=x, fn=fn, dots="*fp32", squares="*fp32", tokens="i32", width="i32", rows="i32", x_stride="i64"), \
            dict(ROWS=32, BLOCK=mhc_mixes.BLOCK_TOKENS, SPLIT=mhc_mixes.SPLIT, BLOCK_K=mhc_mixes.BLOCK_K, PARTS=parts,
                 UPCAST=False)
    gates = dict(dots="*fp32", squares="*fp32", scale="*fp32", base="*fp32")
    scalars = dict(tokens="i32", width="i32", norm_eps="fp32", hc_eps="fp32")
    for column_row in (False, True):
        yield f"mhc_mixes_kernel[column_row {column_row}]", mhc_mixes.mhc_mixes_kernel, {
            **gates, "pre": "*fp32", "post": "*fp32", "comb": "*fp32", **scalars}, \
            dict(SPLITS=64, HC=4, ROWS=32, ITERS=20, BLOCK=mhc_mixes.FINISH_TOKENS, COLUMN_ROW=column_row)
    yield "mhc_head_kernel", mhc_mixes.mhc_head_kernel, {**gates, "weights": "*fp32", **scalars}, \
        dict(SPLITS=64, HC=4, ROWS=16, BLOCK=mhc_mixes.FINISH_TOKENS)
    for head, rows, column_row in ((False, 32, False), (False, 32, True), (True, 16, False)):
        yield f"mhc_mixes_one_pass[head {head}, column_row {column_row}]", mhc_mixes.mhc_mixes_one_pass, dict(
            x="*bf16", fn="*bf16", dots="*fp32", squares="*fp32", arrivals="*i32", scale="*fp32", base="*fp32",
            pre="*fp32", post="*fp32", comb="*fp32", tokens="i32", width="i32", rows="i32", x_stride="i64",
            norm_eps="fp32", hc_eps="fp32"), \
            dict(ROWS=rows, BLOCK=mhc_mixes.BLOCK_TOKENS, SPLIT=mhc_mixes.SPLIT, BLOCK_K=mhc_mixes.BLOCK_K, PARTS=3,
                 UPCAST=False, SPLITS=64, HC=4, ITERS=0 if head else 20, HEAD=head, FINISH=16, COLUMN_ROW=column_row)
    yield "mhc_pre_kernel", mhc_streams.mhc_pre_kernel, dict(residual="*bf16", pre="*fp32", out="*bf16", hidden="i32"), \
        dict(HC=4, BLOCK=mhc_streams.BLOCK_HIDDEN)
    for read_next, norm in ((False, False), (True, False), (True, True)):
        yield f"mhc_post_kernel[read next {read_next}, norm {norm}]", mhc_streams.mhc_post_kernel, dict(
            y="*bf16", residual="*bf16", post="*fp32", comb="*fp32", pre="*fp32", out="*bf16", x="*bf16",
            norm_weight="*fp32", hidden="i32", norm_eps="fp32"), \
            dict(HC=4, BLOCK=4096 if norm else mhc_streams.BLOCK_HIDDEN, READ_NEXT=read_next, NORM=norm)
    for head in (0, 448):
        yield f"rope_kernel[head {head}]", rope.rope_kernel, dict(
            x="*bf16", positions="*i64", cos_sin="*fp32", out="*bf16", rows="i32", heads="i32", x_row_stride="i32",
            out_row_stride="i32", table_stride="i32", sign="fp32"), \
            dict(HEAD=head, ROPE=64, HALF_BLOCK=32, COPY_HEAD=head > 0, BLOCK_ROWS=32, HEAD_CHUNK=rope.HEAD_CHUNK)
    for y, add, weighted in (("*fp32", False, True), ("*bf16", True, True), ("*fp32", True, False)):
        yield f"ep_combine_kernel[{y} add={add} weighted={weighted}]", ep_combine.ep_combine_kernel, dict(
            y=y, row_of_pair="*i64", weights="*fp32", routed="*i8", add="*bf16", out="*bf16" if add else y,
            hidden="i32"), dict(TOP_K=6, HAS_ROUTED=True, HAS_ADD=add, WEIGHTED=weighted, BLOCK=ep_combine.BLOCK_HIDDEN)
    for fmt, kind in sorted(__import__("deepinfer_backends.sm100.kv_load", fromlist=["KINDS"]).KINDS.items()):
        from deepinfer.hal.formats import token_format

        spec = token_format(fmt)
        narrow = fmt == "index_fp4"  # the model's indexer keys: int32 rows, bf16 out
        yield f"kv_load_kernel[{fmt}]", kv_load.kv_load_kernel, dict(
            rows="*u8", bf16_rows="*bf16", fp8_rows="*fp8e4nv", slots="*i32" if narrow else "*i64",
            out="*bf16" if narrow else "*fp32", n="i32"), \
            dict(ROW_BYTES=spec.bytes_per_token, DIM=spec.dim, KIND=kind, BLOCK_ROWS=kv_load.BLOCK_ROWS)
    yield "mxfp4_cast_kernel", mxfp4_cast.mxfp4_cast_kernel, dict(x="*bf16", out="*bf16", rows="i32", heads="i32",
                                                                  out_heads="i32", out_dim="i32"), \
        dict(DIM=128, BLOCK_ROWS=mxfp4_cast.BLOCK_ROWS)
    yield "swiglu_kernel", swiglu.swiglu_kernel, dict(gate="*fp32", up="*fp32", out="*bf16", count="i64", limit="fp32"), \
        dict(CLAMP=True, BLOCK=swiglu.BLOCK)
    for width, gated, block_e in ((16, False, 0), (64, False, 16), (32, True, 0), (32, True, 64)):
        yield f"grouped_gemm_skinny_kernel[{width} columns, gated {gated}, experts in kernel {block_e}]", \
            grouped_gemm_skinny.grouped_gemm_skinny_kernel, dict(
                x="*bf16", w="*bf16", w_up="*bf16", y="*bf16", schedule="*i64" if block_e else "*i32", tiles="i32",
                experts="i32", n="i32", k="i32", limit="fp32"), \
            dict(BLOCK_T=grouped_gemm_skinny.BLOCK_T, BLOCK_N=width, BLOCK_K=grouped_gemm_skinny.BLOCK_K,
                 NUM_STAGES=grouped_gemm_skinny.NUM_STAGES, GATED=gated, CLAMP=gated, BLOCK_E=block_e)
    variants = ((1, False, 0, False), (5, True, 0, False), (2, True, 64, False), (2, False, 64, False),
                (3, False, 0, True), (3, True, 0, True))
    for (weights, one_row, rope, gated), tiles in zip(variants, [*linear_skinny.TILES.values()] * 3):
        plain = (False, "*bf16", False)
        inputs = (plain, (True, "*fp32", tiles["block_n"] == 32)) if rope else (plain,)
        for (norm, x, mxfp4), fp8 in itertools.product(inputs, (False, True)):
            w, y = ("*u8", "*fp32") if fp8 else ("*bf16", "*bf16")
            # Triton passes a row count of 1 as a constant
            yield f"linear_skinny_kernel[{weights} weights, one row {one_row}, rope {rope}, gated {gated}, " \
                  f"norm {norm}, mxfp4 {mxfp4}, fp8 {fp8}, {tiles['block_n']} columns]", \
                linear_skinny.linear_skinny_kernel, dict(
                    x=x, **{f"w{i}": w for i in range(5)}, y=y, **({} if one_row else {"rows": "i32"}),
                    k="i32", x_stride="i32", **{f"end{i}": "i32" for i in range(5)}, positions="*i64",
                    cos_sin="*fp32", table_stride="i32", **{f"head{i}": "i32" for i in range(5)}, w_up=w,
                    gated_from="i32", limit="fp32", norm_weight="*fp32", norm_eps="fp32", mxfp4_mask="i32",
                    **{f"s{i}": "*u8" if fp8 else x for i in range(5)}, s_up="*u8" if fp8 else x), \
                dict(WEIGHTS=weights, BLOCK_T=linear_skinny.BLOCK_T, BLOCK_N=tiles["block_n"],
                     BLOCK_K=tiles["block_k"], NUM_STAGES=tiles["stages"], ROPE=rope, GATED=gated, CLAMP=gated,
                     NORM=norm, MXFP4=mxfp4, FP8=fp8, **({"rows": 1} if one_row else {}))
    yield "align_fp8_kernel", align_fp8.align_fp8_kernel, dict(
        x="*u8", x_scale="*u8", schedule="*i32", out="*u8", out_scale="*fp32", k="i32", tiles="i32"), \
        dict(TILE_ROWS=align_fp8.BLOCK_M, GROUP=align_fp8.GROUP, BLOCK=align_fp8.BLOCK,
             ROUNDER=align_fp8.SUBNORMAL_ROUNDER)
    for x, scaled in (("*bf16", False), ("*fp32", False), ("*fp32", True)):
        kernel = quantize_activations.quantize_activations_kernel
        yield f"quantize_activations_kernel[{x} row_scale={scaled}]", kernel, dict(
            x=x, row_scale="*fp32" if scaled else x, data="*u8", scale="*u8", rows="i32", k="i32", x_stride="i32"), \
            dict(HAS_ROW_SCALE=scaled, BLOCK_ROWS=quantize_activations.BLOCK_ROWS, BLOCK_K=quantize_activations.BLOCK_K,
                 BLOCK=quantize_activations.BLOCK)
    for experts in (16, 384):
        yield f"tile_schedule_kernel[{experts} experts]", tile_schedule.tile_schedule_kernel, dict(
            sizes="*i64", out="*i32", experts="i32", tiles="i32"), \
            dict(TILE_ROWS=64, BLOCK_E=triton_next_power_of_2(experts),
                 BLOCK_T=max(16, tile_schedule.TILE_ELEMENTS // triton_next_power_of_2(experts)))


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


KERNELS = list(_kernels()) if importlib.util.find_spec("triton") else []


@pytest.mark.parametrize("name,kernel,signature,constants", KERNELS, ids=[k[0] for k in KERNELS])
def test_triton_kernel_compiles_for_hopper(name, kernel, signature, constants):
    assert hopper_cubin(kernel, signature, constants), f"{name}: no cubin"

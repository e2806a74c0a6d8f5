"""The ascend950 sparse MLA plan on a CPU: its buffers fit the A5 budget for the model's shapes
and every cache format; the kernels' whole, padded key tiles are the emulation's tiles (padding
changes no bit); the FP8 cache rows the decode kernel dequantizes are exact in bf16 and its scale
pairs are the cache's bytes; the emulation over quantized caches matches the reference."""
import pytest
import torch

from deepinfer.hal.formats import decode_tokens, encode_tokens
from deepinfer.hal.ops.mla import mla_sparse_decode as reference_decode
from deepinfer_backends.ascend950.buffers import ALIGNMENT, layout
from deepinfer_backends.ascend950.emulate import grouped_gemm as gg
from deepinfer_backends.ascend950.emulate import mla


@pytest.mark.parametrize("element", [2, 4])
@pytest.mark.parametrize("cache_formats", [(), ("fp8",), ("fp8", "fp4")])
@pytest.mark.parametrize("masked", [False, True])
def test_mla_plans_fit_the_a5_buffers_for_the_model_shapes(element, cache_formats, masked):
    plan = mla.buffers(512, element, cache_formats, masked)
    offsets = layout(plan, "A5")
    assert all(offsets[b.name] % ALIGNMENT[b.scope] == 0 for b in plan)
    scratch = ["reduce_scratch", "gather_scratch"] if "fp4" in cache_formats else ["reduce_scratch"]
    assert [b.name for b in plan[-len(scratch):]] == scratch  # the lowering puts its scratch after the planned buffers


def test_an_unknown_cache_format_has_no_plan():
    with pytest.raises(ValueError, match=r"cache formats \['fp6'\]"):
        mla.buffers(512, 2, ("fp6",))


def test_blocks_are_one_per_token_and_group_of_64_heads():
    assert mla.blocks(5, 64) == 5 and mla.blocks(3, 128) == 6 and mla.blocks(4, 2) == 4


@pytest.mark.parametrize("main, total", [(0, 64), (64, 64), (20, 20), (148, 248), (128, 640), (1, 130)])
def test_padded_lists_give_the_emulations_tiles_each_whole(main, total):
    padded_main, padded_total = mla.padded_lists(main, total)
    tiles, whole = mla.key_tiles(main, total), mla.key_tiles(padded_main, padded_total)
    assert len(tiles) == len(whole) and all(k1 - k0 == mla.KEY_TILE for k0, k1 in whole)
    starts = [k0 - (0 if k0 < main else main) for k0, _ in tiles]
    assert starts == [k0 - (0 if k0 < padded_main else padded_main) for k0, _ in whole]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_each_list_to_whole_tiles_gives_the_same_attention(dtype):
    """The kernels take each index list padded with -1 to whole tiles; the emulation gives the
    same results with the padding as without, but for the float32 summation order of the
    shorter tiles' products."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads, dim, rows, main, extra = 3, 64, 512, 700, 148, 100
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(rows, dim, generator=gen).to(dtype)
    indices = torch.randint(0, rows, (tokens, main + extra), generator=gen, dtype=torch.int32)
    indices[1, 30:main] = -1
    sink = torch.randn(heads, generator=gen)
    padded_main, padded_total = mla.padded_lists(main, main + extra)
    padded = torch.full((tokens, padded_total), -1, dtype=torch.int32)
    padded[:, :main], padded[:, padded_main:padded_main + extra] = indices[:, :main], indices[:, main:]
    want = mla.mla_sparse_prefill(q, kv, indices, sink, dim ** -0.5, main_keys=main)
    got = mla.mla_sparse_prefill(q, kv, padded, sink, dim ** -0.5, main_keys=padded_main)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_cache_rows_decode_exactly_to_bf16(fmt):
    """The vector cores round each decoded cache value to the cube's bf16 once: it must be exact."""
    rows = encode_tokens(torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 30, fmt)
    values = decode_tokens(rows, fmt)
    assert torch.equal(values.to(torch.bfloat16).float(), values)


def test_fp8_cache_scales_read_as_int16_pairs_are_the_cache_bytes():
    """The decode kernel reads a row's 16 UE8M0 bytes as 8 int16 words, low byte first."""
    rows = encode_tokens(torch.randn(64, 512, generator=torch.Generator().manual_seed(2)), "fp8")
    scale_bytes = rows[:, 512:].contiguous()
    assert torch.equal(gg.unpack_scales(scale_bytes.view(torch.int16), 16), scale_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_fp8_and_fp4_caches_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    batch, s_q, heads = 2, 1, 64
    q = torch.randn(batch, s_q, heads, 512, generator=gen).to(dtype)
    cache = encode_tokens(torch.randn(256, 512, generator=gen), "fp8").reshape(4, 64, 528)
    extra = encode_tokens(torch.randn(512, 512, generator=gen), "fp4").reshape(4, 128, 288)
    indices = torch.randint(0, 256, (batch, s_q, 100), generator=gen, dtype=torch.int32)
    extra_indices = torch.randint(0, 512, (batch, s_q, 70), generator=gen, dtype=torch.int32)
    indices[0, 0, 90:], extra_indices[1, 0, 10:] = -1, -1
    sink = torch.randn(heads, generator=gen)
    args = (q, cache, indices, sink, 512 ** -0.5, "fp8", extra, extra_indices, "fp4")
    out, lse = mla.mla_sparse_decode(*args)
    want_out, want_lse = reference_decode(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want_out.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_the_decode_kernel_refuses_what_it_cannot_read_with_the_reason():
    from deepinfer_backends.ascend950.kernels.mla_sparse_decode import mla_sparse_decode_kernel

    args = dict(tokens=2, heads=64, dim=512, topk=192, kv_rows=100, head_group=64, key_tile=64, d_split=128, cores=2,
                scale=0.1, offsets={}, cache_format="fp8", masked=True, extra_rows=100)
    with pytest.raises(ValueError, match=r"reads \['fp4', 'fp8'\] extra rows, not 'bf16'"):
        mla_sparse_decode_kernel(**args, extra_format="bf16", main_keys=128)
    with pytest.raises(ValueError, match=r"reads bf16 or \['fp4', 'fp8'\] cache rows, not 'index_fp4'"):
        mla_sparse_decode_kernel(**{**args, "cache_format": "index_fp4"})
    with pytest.raises(ValueError, match="main_keys=100 must be a multiple of key_tile=64 within topk=192"):
        mla_sparse_decode_kernel(**args, extra_format="fp4", main_keys=100)
    with pytest.raises(ValueError, match="main_keys=None"):
        mla_sparse_decode_kernel(**args, extra_format="fp4")
    with pytest.raises(ValueError, match="masked must be set"):
        mla_sparse_decode_kernel(**{**args, "masked": False}, extra_format="fp4", main_keys=128)
    with pytest.raises(ValueError, match="holds 512 values, not dim=256"):
        mla_sparse_decode_kernel(**{**args, "dim": 256, "cache_format": "bf16"}, extra_format="fp4", main_keys=128)

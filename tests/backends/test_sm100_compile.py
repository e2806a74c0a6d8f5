"""The sm100 backend without a GPU: what it declares, how its wrappers refuse bad input, and what
every TileLang kernel compiles to for sm_90a (the matrix kernels on wgmma), and the portable matrix
kernels for sm_100a: measured from the cubin (registers, spills, shared memory, SASS instructions,
see ``cubin_checks``). The kernel tests need tilelang (``pip install -e '.[sm100]'``) and nvcc;
they skip with that reason where either is missing (the default CI has neither)."""
import functools
import importlib.util
import subprocess
import sys

import pytest
import torch

from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.formats import quantize
from deepinfer_backends.sm100 import gemm, linear, toolchain
from deepinfer_backends.sm100.attention import mla_kernel
from deepinfer_backends.sm100.grouped_gemm_native import NATIVE_TILES
from tests.backends import cubin_checks

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="tilelang is not installed (pip install -e '.[sm100]')")


def test_importing_the_backend_imports_neither_tilelang_nor_triton():
    code = ("import sys, deepinfer_backends.sm100 as b; b.Sm100Backend().implementations(); "
            "print('tilelang' in sys.modules, 'triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False False"


def test_every_op_is_implemented_or_declined_with_a_reason():
    backend = get_backend("sm100")
    implemented, declined = set(backend.implementations()), backend.unsupported_reasons()
    assert set(declined) == {"kv_cast", "kv_store", "candidate_blocks", "engram_gate", "engram_hash"}, \
        "only ops off the inference path of V4.1-Flash without Engram may lack a kernel"
    assert implemented.isdisjoint(declined)
    assert implemented | set(declined) == set(SPECS)
    assert all("reference" in reason for reason in declined.values())
    caps = backend.capabilities
    assert caps.device_types == {"cuda"} and caps.dtypes == {torch.bfloat16} and caps.batch_invariant


def test_batch_invariant_table_turns_split_kv_off_and_fixes_the_gemm_tiles():
    """Split-KV off for both MLA ops, and prefill in decode's key blocks; fixed GEMM tiles."""
    from deepinfer_backends.sm100 import INVARIANT, wrappers

    backend = get_backend("sm100")
    table = backend.implementations(batch_invariant=True)
    assert set(table) == set(INVARIANT) <= set(backend.implementations())
    chosen = {"options": backend.options}
    assert table["mla_sparse_decode"].keywords == {**chosen, "split_kv": False}
    assert table["mla_sparse_prefill"].keywords == {**chosen, "split_kv": False, "batch_invariant": True}
    for op in ("mla_sparse_decode", "mla_sparse_prefill"):
        assert table[op].func is getattr(wrappers, op)
    assert table["grouped_gemm"].keywords == {**chosen, "batch_invariant": True}
    assert table["linear"].keywords == table["grouped_linear"].keywords == {**chosen, "batch_invariant": True}
    assert table["rms_norm"] is wrappers.rms_norm
    shapes = [(rows, experts) for rows in (1, 7, 64, 300, 20000) for experts in (1, 8, 256)]
    assert len({tuple(wrappers.gemm_tiles(r, e, 4096, 4096, batch_invariant=True).items()) for r, e in shapes}) == 1
    assert len({tuple(wrappers.gemm_tiles(r, e, 4096, 4096).items()) for r, e in shapes}) > 1


def test_wrappers_refuse_inputs_they_do_not_cover():
    from deepinfer_backends.sm100.wrappers import UnsupportedInput

    ops = get_backend("sm100").implementations()
    x, w, sizes = torch.randn(4, 64), torch.randn(2, 16, 64), torch.tensor([1, 3])
    with pytest.raises(UnsupportedInput, match=r"weight Quantized 'fp8' or 'mxfp4' with block 32, got a torch.float32 "
                                               r"tensor.*overrides\.grouped_gemm=reference"):
        ops["grouped_gemm"](quantize(x, "fp8"), w, sizes)  # FP8 x goes with FP8 / MXFP4 weights only
    with pytest.raises(UnsupportedInput, match=r"x must be a bfloat16 CUDA tensor, got torch.float32 on cpu"):
        ops["grouped_gemm"](x, w, sizes)
    q = torch.randn(1, 1, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match="q must be a bfloat16 CUDA tensor"):
        ops["mla_sparse_decode"](q, torch.zeros(4, 528, dtype=torch.uint8), torch.zeros(1, 1, 2, dtype=torch.int32),
                                 torch.zeros(2), 512 ** -0.5)
    with pytest.raises(UnsupportedInput, match="extra cache in 'fp4' beside a 'bf16' main cache"):
        ops["mla_sparse_decode"](q, torch.zeros(4, 1024, dtype=torch.uint8), torch.zeros(1, 1, 2, dtype=torch.int32),
                                 torch.zeros(2), 512 ** -0.5, cache_format="bf16",
                                 extra_cache=torch.zeros(4, 288, dtype=torch.uint8),
                                 extra_indices=torch.zeros(1, 1, 2, dtype=torch.int32))
    with pytest.raises(UnsupportedInput, match="x must be a CUDA tensor"):
        ops["rms_norm"](x, torch.ones(64), 1e-6)
    with pytest.raises(UnsupportedInput, match=r"x must be a bfloat16 CUDA tensor.*overrides\.linear=reference"):
        ops["linear"](x, w[0])


def test_kv_norm_rope_store_refuses_what_it_does_not_cover():
    from deepinfer_backends.sm100.wrappers import UnsupportedInput

    ops = get_backend("sm100").implementations()
    latent, positions, cos_sin = torch.randn(2, 512, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), \
        torch.zeros(4, 64)
    with pytest.raises(UnsupportedInput, match=r"cache format 'index_bf16' is not implemented \(fp8, bf16, fp4, "
                                               r"index_fp4 are\).*overrides\.kv_norm_rope_store=reference"):
        ops["kv_norm_rope_store"](latent[:, :128], torch.ones(128), 1e-6, positions, cos_sin,
                                  torch.zeros(4, 256, dtype=torch.uint8), positions, "index_bf16")
    for x in (latent, latent.half()):  # on the CPU, then not a float type the kernel reads
        with pytest.raises(UnsupportedInput, match=rf"x must be a bfloat16 or float32 CUDA tensor, got {x.dtype} "
                                                   r"on cpu.*overrides\.kv_norm_rope_store=reference"):
            ops["kv_norm_rope_store"](x, torch.ones(512), 1e-6, positions, cos_sin,
                                      torch.zeros(4, 288, dtype=torch.uint8), positions, "fp4")


def test_tile_schedule_covers_each_segment_once():
    pytest.importorskip("tilelang")  # the kernel module imports it
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

    sizes = torch.tensor([0, 3, 0, 130, 64, 0])
    expert, first, end = tile_schedule(sizes, int(sizes.sum()), block_m=64).tolist()
    tiles = [(e, f, min(f + 64, n)) for e, f, n in zip(expert, first, end) if e < len(sizes)]
    assert tiles == [(1, 0, 3), (3, 3, 67), (3, 67, 131), (3, 131, 133), (4, 133, 197)]
    assert len(expert) == -(-197 // 64) + len(sizes)


def test_split_count_weighs_each_ctas_fixed_cost(monkeypatch):
    """Hand-worked on 132 SMs: cost = waves x (key blocks of a split + 1)."""
    from types import SimpleNamespace

    from deepinfer_backends.sm100.attention import split_count

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert split_count(1024, 10, 0, "cuda") == 1  # prefill rows fill 8 waves: 8 x 11 beats 16 x 6 and 39 x 3
    assert split_count(256, 2, 8, "cuda") == 1  # 2 x 11 beats 4 x 6
    assert split_count(64, 2, 8, "cuda") == 2  # 1 x 6 beats 1 x 11 and 2 x 5
    assert split_count(1, 2, 8, "cuda") == 8  # 1 x 3: one block of each list per split


def test_linear_kernel_is_chosen_by_rows_options_and_batch_invariance():
    """``auto``: cuBLAS at every row count, the TileLang GEMM in batch-invariant mode; the fixed
    choices hold whatever the rows, and cuBLAS is refused in batch-invariant mode (at the call and
    when the backend builds its table)."""
    from deepinfer_backends.sm100.options import KernelOptions

    auto = KernelOptions()
    assert linear.linear_kernel(auto) == "cublas"
    assert linear.linear_kernel(auto, batch_invariant=True) == "tilelang"
    for fixed in ("tilelang", "cublas"):
        assert linear.linear_kernel(KernelOptions(linear_kernel=fixed)) == fixed
    assert linear.linear_kernel(KernelOptions(linear_kernel="tilelang"), batch_invariant=True) == "tilelang"
    with pytest.raises(RuntimeError, match="cannot serve batch-invariant mode"):
        linear.linear_kernel(KernelOptions(linear_kernel="cublas"), batch_invariant=True)
    with pytest.raises(ValueError, match="linear_kernel=cublas cannot serve engine.batch_invariant=true"):
        get_backend("sm100", options={"linear_kernel": "cublas"}).implementations(batch_invariant=True)
    with pytest.raises(ValueError, match=r"linear_kernel='fast'"):
        KernelOptions(linear_kernel="fast")


def test_native_fp8_grouped_gemm_is_taken_only_where_it_applies():
    """``quant_gemm=native``: FP8 activations on Hopper with more than 16 rows per expert on
    average and K a positive multiple of 128, outside the batch-invariant mode and tcgen05; bf16
    activations, few rows, K = 0, Blackwell and those modes keep the exact kernels. An unknown
    choice is refused."""
    from deepinfer.hal.formats import quantize
    from deepinfer_backends.sm100.grouped_gemm_native import native_fits
    from deepinfer_backends.sm100.options import KernelOptions

    fp8 = quantize(torch.randn(4, 128), "fp8")
    assert native_fits(fp8, 17 * 8, 8, 128, toolchain.HOPPER, False, False)
    assert not native_fits(fp8, 16 * 8, 8, 128, toolchain.HOPPER, False, False)
    assert not native_fits(fp8, 17 * 8, 8, 0, toolchain.HOPPER, False, False)
    assert not native_fits(torch.randn(4, 128), 17 * 8, 8, 128, toolchain.HOPPER, False, False)
    assert not native_fits(fp8, 17 * 8, 8, 128, toolchain.BLACKWELL, False, False)
    assert not native_fits(fp8, 17 * 8, 8, 128, toolchain.HOPPER, True, False)
    assert not native_fits(fp8, 17 * 8, 8, 128, toolchain.HOPPER, False, True)
    assert KernelOptions().quant_gemm == "exact"
    with pytest.raises(ValueError, match=r"quant_gemm='fast'"):
        KernelOptions(quant_gemm="fast")


def test_sparse_mla_kernel_is_chosen_by_arch_and_options_and_lists_align_to_its_key_block():
    """Hopper: the warp-specialised kernel, decode on 32-key blocks (a lane per quantized key row),
    batch-invariant prefill on decode's very blocks, other prefill on longer ones; Blackwell and
    ``mla_kernel=portable``: the portable kernel, decode and prefill alike."""
    from deepinfer_backends.sm100.attention import align_lists, key_block
    from deepinfer_backends.sm100.options import KernelOptions

    decode = mla_kernel("mla_sparse_decode", toolchain.HOPPER)
    assert decode[:2] == ("mla_sparse_ws", "sparse_mla_ws") and key_block(decode) == 32
    assert mla_kernel("mla_sparse_prefill", toolchain.HOPPER, batch_invariant=True) == decode
    prefill = mla_kernel("mla_sparse_prefill", toolchain.HOPPER)
    assert prefill[:2] == decode[:2] and key_block(prefill) > key_block(decode)
    portable = [mla_kernel(op, toolchain.BLACKWELL) for op in ("mla_sparse_decode", "mla_sparse_prefill")]
    assert portable[0] == portable[1] and portable[0][:2] == ("mla_sparse_decode", "sparse_mla")
    options = KernelOptions(mla_kernel="portable")
    assert mla_kernel("mla_sparse_decode", toolchain.HOPPER, options=options) == portable[0]
    warp_specialized = KernelOptions(mla_kernel="warp_specialized")
    assert mla_kernel("mla_sparse_decode", toolchain.HOPPER, options=warp_specialized) == decode
    with pytest.raises(RuntimeError, match="mla_kernel=warp_specialized needs Hopper"):
        mla_kernel("mla_sparse_decode", toolchain.BLACKWELL, options=warp_specialized)
    indices = torch.arange(6, dtype=torch.int32).reshape(1, 6)
    assert align_lists(indices, 2, block=64).tolist() == [[0, 1] + [-1] * 62 + [2, 3, 4, 5]]
    assert align_lists(indices, 2, block=32).tolist() == [[0, 1] + [-1] * 30 + [2, 3, 4, 5]]
    assert align_lists(indices, 6, block=32) is indices and align_lists(indices, None, block=32) is indices


KERNELS = {  # name: (kernel module, factory, args, kwargs, uses the tensor cores); the wrappers' tiles where served
    "grouped_gemm": ("grouped_gemm", "grouped_gemm_bf16", (4, 2048, 4096), {}, True),
    "grouped_gemm_small_tiles": ("grouped_gemm", "grouped_gemm_bf16", (2, 24, 96),
                                 gemm.bf16_kernel(40, 2, 24, 96, toolchain.HOPPER, batch_invariant=True)[2], True),
    "grouped_gemm_ws": ("grouped_gemm_ws", "grouped_gemm_bf16_ws", (4, 2048, 4096),
                        gemm.bf16_kernel(12288, 4, 2048, 4096, toolchain.HOPPER)[2], True),
    "grouped_gemm_ws_small_tiles": ("grouped_gemm_ws", "grouped_gemm_bf16_ws", (2, 24, 96),
                                    gemm.bf16_kernel(40, 2, 24, 96, toolchain.HOPPER)[2], True),
    "grouped_swiglu": ("grouped_swiglu", "grouped_swiglu_bf16_ws", (4, 2048, 4096, 10.0),
                       {"block_m": 128, "block_n": 128, "num_stages": gemm.WS_STAGES}, True),
    "grouped_swiglu_small_tiles": ("grouped_swiglu", "grouped_swiglu_bf16_ws", (2, 128, 96, None),
                                   {"block_m": 64, "block_n": 128, "num_stages": gemm.WS_STAGES}, True),
    "mla_sparse_decode": ("mla_sparse_decode", "sparse_mla", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}, True),
    "mla_sparse_decode_split": ("mla_sparse_decode", "sparse_mla", (128, 512, 6, 5, 512 ** -0.5, "fp8"),
                                {"splits": 2}, True),
    "mla_sparse_decode_combine": ("mla_sparse_decode", "combine", (64, 512, 4), {}, False),
    "mla_sparse_prefill": ("mla_sparse_decode", "sparse_mla", (64, 64, 8, 0, 64 ** -0.5, "bf16"), {}, True),
    "mla_sparse_ws": ("mla_sparse_ws", "sparse_mla_ws", (64, 512, 128, 512, 512 ** -0.5, "fp8"),
                      mla_kernel("mla_sparse_decode", toolchain.HOPPER)[2], True),
    "mla_sparse_ws_prefill": ("mla_sparse_ws", "sparse_mla_ws", (64, 512, 640, 0, 512 ** -0.5, "bf16"),
                              mla_kernel("mla_sparse_prefill", toolchain.HOPPER)[2], True),
    "mla_sparse_ws_split_bf16": ("mla_sparse_ws", "sparse_mla_ws", (128, 64, 100, 0, 0.1, "bf16"), {"splits": 3},
                                 True),
    "grouped_gemm_fp8_k128": ("grouped_gemm_fp8_k128", "grouped_gemm_fp8_k128", (48, 4096, 2048),
                              NATIVE_TILES, True),
    "grouped_gemm_fp8_k128_bf16": ("grouped_gemm_fp8_k128", "grouped_gemm_fp8_k128", (48, 4096, 2048),
                                   dict(NATIVE_TILES, out_dtype="bfloat16"), True),
    "grouped_gemm_fp8_k128_bf16_blocks": ("grouped_gemm_fp8_k128", "grouped_gemm_fp8_k128", (48, 4096, 2048),
                                          dict(NATIVE_TILES, out_dtype="bfloat16", blocks=5), True),
    "key_decode_fp8": ("key_decode", "decode_rows", ("fp8",), {}, False),
    "key_decode_fp4": ("key_decode", "decode_rows", ("fp4",), {}, False),
    "rms_norm": ("rms_norm", "rms_norm", (4096, 1e-6, "bfloat16", "bfloat16"), {"threads": 256}, False),
    "rms_norm_small": ("rms_norm", "rms_norm", (96, 1e-6, "float", None), {"threads": 32}, False),
    "indexer_logits": ("indexer_logits", "indexer_logits", (64, 128), {}, True),
    "indexer_logits_per_sequence": ("indexer_logits", "indexer_logits", (64, 128), {"queries_per_seq": 6}, True),
    "kv_norm_rope_store": ("kv_norm_rope_store", "kv_norm_rope_store", (512, 64, 1e-6, "fp8"), {}, False),
    "kv_norm_rope_store_bf16": ("kv_norm_rope_store", "kv_norm_rope_store", (512, 64, 1e-6, "bf16"), {}, False),
    "kv_norm_rope_store_fp4": ("kv_norm_rope_store", "kv_norm_rope_store", (512, 64, 1e-6, "fp4", "float32"), {},
                               False),
    "kv_norm_rope_store_index_fp4": ("kv_norm_rope_store", "kv_norm_rope_store",
                                     (128, 64, 1e-6, "index_fp4", "bfloat16"), {}, False),
}
SPILLS = {(toolchain.HOPPER, "mla_sparse_decode"), (toolchain.HOPPER, "mla_sparse_decode_split"),
          (toolchain.HOPPER, "mla_sparse_ws"), (toolchain.BLACKWELL, "mla_sparse_decode")}
"""Kernels ptxas is known to spill registers in on that arch (their GPU tests check their results)."""


@functools.lru_cache(maxsize=None)
def _lower(name: str, arch: str) -> cubin_checks.Lowered:
    module, factory, args, kwargs, _ = KERNELS[name]
    jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
    return cubin_checks.lower(jit, *args, arch=arch, **kwargs)


def _compile(name: str, arch: str = toolchain.HOPPER) -> cubin_checks.Cubin:
    return cubin_checks.compile_cubin(_lower(name, arch))


def _spill_cases(arch: str, names) -> list:
    return [pytest.param(name, marks=pytest.mark.xfail(reason=f"ptxas spills registers in {name} on {arch}"))
            if (arch, name) in SPILLS else name for name in names]


@needs_tilelang
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_hopper_within_a_ctas_limits(name):
    """nvcc and ptxas accept the generated code for sm_90a; its registers, shared memory and
    warpgroup register budgets fit one CTA of an H100/H200; the matrix kernels run on wgmma
    (HGMMA in the SASS, QGMMA for e4m3) and none on the older mma.sync (HMMA)."""
    cubin = _compile(name)
    cubin_checks.assert_fits(cubin)
    assert (cubin.count("HGMMA") + cubin.count("QGMMA") > 0) == KERNELS[name][4] and cubin.count("HMMA") == 0


@needs_tilelang
@pytest.mark.parametrize("name", _spill_cases(toolchain.HOPPER, sorted(KERNELS)))
def test_kernel_keeps_its_values_in_registers_on_hopper(name):
    cubin_checks.assert_no_spill(_compile(name))


@needs_tilelang
def test_warp_specialised_mla_gets_the_register_budgets_it_asks_for_and_refuses_bad_ones():
    """Each warpgroup budget asked for reaches the SASS as a ``setmaxnreg``: lowered from the launch
    count when under it, raised when over (:func:`cubin_checks.assert_fits` checks the direction).
    Budgets that are not multiples of 8 or add up to more than 504 are refused, and so is a
    producer register batch (``held_calls``) that does not divide a block's decode calls, and a
    quantized key block other than 32 rows (the decode maps a lane to a row)."""
    from deepinfer_backends.sm100.kernels.mla_sparse_ws import sparse_mla_ws

    args, budgets = (64, 512, 128, 512, 512 ** -0.5, "fp8"), (216, 160, 128)
    cubin = cubin_checks.compile_cubin(cubin_checks.lower(sparse_mla_ws, *args, registers=budgets))
    cubin_checks.assert_fits(cubin)
    assert sorted(count for _, count in cubin.register_budgets()) == sorted(budgets)
    for bad in ((216, 168, 128), (212, 160, 128), (208, 168)):
        with pytest.raises(ValueError, match="registers"):
            toolchain.lower_source(sparse_mla_ws, *args, registers=bad)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"held_calls={bad} must divide the 16 decode calls"):
            toolchain.lower_source(sparse_mla_ws, *args, held_calls=bad)
    with pytest.raises(ValueError, match="block_k=64 must be 32 with quantized rows"):
        toolchain.lower_source(sparse_mla_ws, *args, block_k=64, key_stages=2)


@needs_tilelang
def test_warp_specialised_kernels_store_whole_vectors():
    """The bf16 grouped GEMM writes its output tile as 16-byte stores only, and sparse MLA its
    output as 16-byte stores with only the lse's floats narrower (stores from the accumulator
    layout would be 4 bytes each)."""
    gemm_stores = [line.split()[0] for line in _compile("grouped_gemm_ws").sass if line.startswith("STG")]
    assert gemm_stores and all(".128" in store for store in gemm_stores)
    mla_stores = [line.split()[0] for line in _compile("mla_sparse_ws").sass if line.startswith("STG")]
    wide = sum(".128" in store for store in mla_stores)
    assert not any(".U16" in store for store in mla_stores) and len(mla_stores) - wide < wide


@needs_tilelang
@pytest.mark.parametrize("name", ["grouped_gemm_fp8_k128_bf16", "grouped_gemm_fp8_k128_bf16_blocks"])
def test_native_fp8_gemm_stores_bf16_results_a_sector_per_lane_pair(name):
    """The native FP8 grouped GEMM's bf16 epilogue stores 16 bytes a lane (after its quad shuffles)
    from registers: no 2- or 4-byte stores of the result, no local memory for the accumulator it
    reads through a pointer, also when a CTA stores several column blocks from inside its loop."""
    cubin = _compile(name)
    stores = [line.split()[0] for line in cubin.sass if line.startswith("STG")]
    assert stores and all(".128" in store for store in stores) and len(stores) >= 208 // 16  # one per chunk pair
    assert cubin.count("SHFL.BFLY") > 0 and cubin.count("STL") == 0 and cubin.count("LDL") == 0


@needs_tilelang
@pytest.mark.parametrize("name", ["key_decode_fp8", "key_decode_fp4"])
def test_key_decode_uses_bf16_multiplies_and_no_conversion_instruction(name):
    """The quantized key rows are decoded by bit moves and bf16 multiplies (HMUL2/HFMA2 ``BF16``),
    with no float conversion instruction (F2F, I2F, F2I, F2FP)."""
    sass = _compile(name).sass
    assert any(line.startswith(("HMUL2.BF16", "HFMA2.MMA.BF16", "HFMA2.BF16")) for line in sass)
    assert not [line for line in sass if line.startswith(("F2F", "I2F", "F2I"))]


@needs_tilelang
def test_the_mla_trace_tool_still_finds_its_anchors_in_the_kernel():
    """``experiments/mla_trace.py`` patches a copy of ``mla_sparse_ws.py`` at anchor lines (and
    raises when one is missing or repeated); after a change to the kernel its copy must still lower."""
    from deepinfer.study import load_script

    mla_trace = load_script("mla_trace")
    mla_trace.load_traced()
    traced = sys.modules[f"deepinfer_backends.sm100.kernels.{mla_trace.TRACE_MODULE}"]
    cubin_checks.assert_launch_fits(cubin_checks.lower(traced.sparse_mla_ws, 64, 512, 128, 512, 512 ** -0.5))


@needs_tilelang
def test_sparse_mla_keeps_short_key_lists_in_static_shared_memory():
    """The key lists sit in static shared memory when they fit (TileLang's sync pass tracks it apart
    from the dynamic buffer the gathers write); a list too long for static shared memory moves to
    the dynamic buffer, and the kernel still fits a CTA."""
    from deepinfer_backends.sm100.kernels.mla_sparse_decode import sparse_mla

    main_keys, extra_keys = KERNELS["mla_sparse_decode"][2][2:4]
    assert _compile("mla_sparse_decode").static_shared >= 4 * (main_keys + extra_keys)
    long_list = cubin_checks.lower(sparse_mla, 64, 64, 16384, 0, 64 ** -0.5, "bf16")
    cubin_checks.assert_launch_fits(long_list)
    assert 4 * 16384 > cubin_checks.MAX_STATIC_SHARED and long_list.dynamic_shared >= 4 * 16384


@needs_tilelang
def test_warp_specialised_grouped_gemm_keeps_one_k_block_in_flight():
    """The served tiles: TMA loads, one 64 x 256 wgmma chain per consumer warpgroup and k-block,
    and a wait until at most one chain is in flight (``wgmma.wait_group 1``) before a ring slot is
    freed, and a final wait for none."""
    tiles = KERNELS["grouped_gemm_ws"][3]
    sass = _compile("grouped_gemm_ws").sass
    assert any(line.startswith("UTMALDG") for line in sass)
    assert any(line.startswith(f"HGMMA.64x{tiles['block_n']}x16.F32.BF16") for line in sass)
    waits = {line.split()[-1] for line in sass if line.startswith("WARPGROUP.DEPBAR.LE")}
    assert waits == {"0x1", "0x0"}


def test_bf16_grouped_gemm_kernel_is_chosen_by_arch_and_mode(monkeypatch):
    """Hopper: the warp-specialised kernel, 128-row tiles for long segments and 64 for short ones,
    256 columns where N allows; batch-invariant: the portable kernel, the same tiles at every row
    count; Blackwell: the portable kernel, or its tcgen05 variant when asked."""
    hopper, blackwell = toolchain.HOPPER, toolchain.BLACKWELL
    module, factory, tiles = gemm.bf16_kernel(12288, 48, 4096, 4096, hopper)
    assert (module, factory) == ("grouped_gemm_ws", "grouped_gemm_bf16_ws")
    assert (tiles["block_m"], tiles["block_n"]) == (128, 256)
    assert gemm.bf16_kernel(192, 48, 4096, 4096, hopper)[2]["block_m"] == 64
    assert gemm.bf16_kernel(40, 2, 24, 96, hopper)[2]["block_n"] == 128
    invariant = [gemm.bf16_kernel(rows, 48, 4096, 4096, hopper, batch_invariant=True) for rows in (1, 192, 12288)]
    assert invariant[0][:2] == ("grouped_gemm", "grouped_gemm_bf16") and invariant.count(invariant[0]) == 3
    assert gemm.bf16_kernel(12288, 48, 4096, 4096, blackwell) == \
        ("grouped_gemm", "grouped_gemm_bf16", gemm.gemm_tiles(12288, 48, 4096, 4096))
    monkeypatch.setattr(toolchain, "device_arch", lambda device_index=0: blackwell)
    assert gemm.bf16_kernel(12288, 48, 4096, 4096, blackwell, tcgen05=True)[:2] == \
        ("experimental.grouped_gemm_tcgen05", "grouped_gemm_bf16")


@needs_tilelang
@pytest.mark.parametrize("name", _spill_cases(toolchain.BLACKWELL, ["grouped_gemm", "mla_sparse_decode"]))
def test_matrix_kernels_compile_for_blackwell_on_mma(name):
    """The portable kernels (the default on every arch) compile for sm_100a within a CTA's limits,
    without spilling, on mma.sync (HMMA) and neither wgmma nor tcgen05; the tcgen05 variants are
    separate modules (tests/backends/test_sm100_tcgen05.py)."""
    cubin = _compile(name, toolchain.BLACKWELL)
    cubin_checks.assert_fits(cubin)
    assert cubin.count("HMMA") and not cubin.count("HGMMA") and not any(line.startswith("UTC") for line in cubin.sass)
    cubin_checks.assert_no_spill(cubin)


@needs_tilelang
@pytest.mark.parametrize("name", ["kv_norm_rope_store", "kv_norm_rope_store_fp4"])
def test_kv_norm_rope_store_rounds_like_the_reference(name):
    """The fp8 and fp4 store kernels' PTX (where rounding modes are still named): IEEE sqrt and
    division (torch's 1 / sqrt on a CPU), a saturating round-to-nearest e4m3 conversion (fp8 values,
    fp4 scales), and no approximate transcendental (scales come from bits)."""
    ptx = _compile(name).ptx
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert not any(approx in ptx for approx in ("rsqrt.approx", "lg2.approx", "ex2.approx", "div.approx"))


def test_every_kernel_module_has_a_main_that_checks_it():
    """``python -m deepinfer_backends.sm100.kernels.<module>`` (or ``fused.<module>``) checks
    that kernel on a GPU; read from the source, since importing a kernel module needs tilelang
    or triton."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "backends" / "sm100"
    modules = [p for folder in ("kernels", "kernels/experimental", "fused") for p in sorted((root / folder).glob("*.py"))
               if p.name != "__init__.py"]
    assert len(modules) >= 20
    missing = [str(p.relative_to(root)) for p in modules
               if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(p.read_text()).body)]
    assert not missing, f"kernel modules without main(): {missing}"

"""The sm100 backend without a GPU: what it declares, how its wrappers refuse bad input, and that
every TileLang kernel lowers for sm_90a (the matrix kernels on wgmma), one kernel of each kind
compiles with nvcc and ptxas, and the matrix kernels lower for sm_100a. The kernel tests need tilelang (``pip install -e '.[sm100]'``)
and nvcc; they skip with that reason where either is missing (the default CI has neither)."""
import functools
import importlib.util
import subprocess
import sys

import pytest
import torch

from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.formats import quantize

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
    assert implemented == {"apply_rope", "ep_combine", "grouped_gemm", "indexer_logits", "kv_load",
                           "kv_norm_rope_store", "linear", "mhc_head", "mhc_mixes", "mhc_post", "mhc_pre",
                           "mla_sparse_decode", "mla_sparse_prefill", "rms_norm", "swiglu"}
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
    assert table["linear"].keywords == {"batch_invariant": True}
    assert table["rms_norm"] is wrappers.rms_norm
    shapes = [(rows, experts) for rows in (1, 7, 64, 300, 20000) for experts in (1, 8, 256)]
    assert {tuple(wrappers.gemm_tiles(r, e, 4096, 4096, batch_invariant=True).items()) for r, e in shapes} == \
        {tuple(wrappers.INVARIANT_TILES.items())}
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


def test_sparse_mla_kernel_is_chosen_by_arch_and_options_and_lists_align_to_its_key_block():
    from deepinfer_backends.sm100 import toolchain
    from deepinfer_backends.sm100.attention import align_lists, key_block, mla_kernel
    from deepinfer_backends.sm100.options import KernelOptions

    ws32 = ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32})
    assert mla_kernel("mla_sparse_decode", toolchain.HOPPER) == ws32
    assert mla_kernel("mla_sparse_prefill", toolchain.HOPPER, batch_invariant=True) == ws32  # decode's blocks
    prefill = mla_kernel("mla_sparse_prefill", toolchain.HOPPER)
    assert prefill == ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 64, "key_stages": 2}) and key_block(prefill) == 64
    for op in ("mla_sparse_decode", "mla_sparse_prefill"):
        assert mla_kernel(op, toolchain.BLACKWELL) == ("mla_sparse_decode", "sparse_mla", {})
        assert key_block(mla_kernel(op, toolchain.BLACKWELL)) == 64
    portable = KernelOptions(mla_kernel="portable")
    assert mla_kernel("mla_sparse_decode", toolchain.HOPPER, options=portable) == ("mla_sparse_decode", "sparse_mla", {})
    warp_specialized = KernelOptions(mla_kernel="warp_specialized")
    assert mla_kernel("mla_sparse_decode", toolchain.HOPPER, options=warp_specialized) == ws32
    with pytest.raises(RuntimeError, match="mla_kernel=warp_specialized needs Hopper"):
        mla_kernel("mla_sparse_decode", toolchain.BLACKWELL, options=warp_specialized)
    indices = torch.arange(6, dtype=torch.int32).reshape(1, 6)
    assert align_lists(indices, 2, block=64).tolist() == [[0, 1] + [-1] * 62 + [2, 3, 4, 5]]
    assert align_lists(indices, 2, block=32).tolist() == [[0, 1] + [-1] * 30 + [2, 3, 4, 5]]
    assert align_lists(indices, 6, block=32) is indices and align_lists(indices, None, block=32) is indices


KERNELS = {  # name: (kernel module, factory, args, kwargs, uses the tensor cores)
    "grouped_gemm": ("grouped_gemm", "grouped_gemm_bf16", (4, 2048, 4096), {}, True),
    "grouped_gemm_small_tiles": ("grouped_gemm", "grouped_gemm_bf16", (2, 24, 96),
                                 {"block_m": 64, "block_n": 128, "threads": 128}, True),
    "grouped_gemm_ws": ("grouped_gemm_ws", "grouped_gemm_bf16_ws", (4, 2048, 4096), {}, True),
    "grouped_gemm_ws_small_tiles": ("grouped_gemm_ws", "grouped_gemm_bf16_ws", (2, 24, 96),
                                    {"block_m": 64, "block_n": 128}, True),
    "mla_sparse_decode": ("mla_sparse_decode", "sparse_mla", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}, True),
    "mla_sparse_decode_split": ("mla_sparse_decode", "sparse_mla", (128, 512, 6, 5, 512 ** -0.5, "fp8"),
                                {"splits": 2}, True),
    "mla_sparse_decode_combine": ("mla_sparse_decode", "combine", (64, 512, 4), {}, False),
    "mla_sparse_prefill": ("mla_sparse_decode", "sparse_mla", (64, 64, 8, 0, 64 ** -0.5, "bf16"), {}, True),
    "mla_sparse_ws": ("mla_sparse_ws", "sparse_mla_ws", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}, True),
    "mla_sparse_ws_prefill": ("mla_sparse_ws", "sparse_mla_ws", (64, 512, 640, 0, 512 ** -0.5, "bf16"),
                              {"block_k": 64, "key_stages": 2}, True),
    "mla_sparse_ws_split_bf16": ("mla_sparse_ws", "sparse_mla_ws", (128, 64, 100, 0, 0.1, "bf16"), {"splits": 3},
                                 True),
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


@functools.lru_cache(maxsize=None)
def _lower(name: str, arch: str) -> str:
    from deepinfer_backends.sm100 import toolchain

    module, factory, args, kwargs, _ = KERNELS[name]
    jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
    return toolchain.lower_source(jit, *args, arch=arch, **kwargs)


@needs_tilelang
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_lowers_for_hopper(name):
    source = _lower(name, "sm_90a")
    assert '__global__ void __launch_bounds__' in source
    assert ("tl::wgmma_ss" in source) == KERNELS[name][4]


@needs_tilelang
@pytest.mark.parametrize("name", ["grouped_gemm", "grouped_gemm_ws", "mla_sparse_decode", "mla_sparse_ws",
                                  "mla_sparse_ws_prefill", "rms_norm",
                                  "indexer_logits", "indexer_logits_per_sequence", "kv_norm_rope_store",
                                  "kv_norm_rope_store_index_fp4",
                                  "key_decode_fp4"])
def test_kernel_compiles_for_hopper_on_wgmma(name):
    """nvcc and ptxas accept the generated code for sm_90a, and the matrix kernels' PTX holds
    wgmma (the Hopper tensor-core path), not the older mma.sync or scalar FMA only."""
    from deepinfer_backends.sm100 import toolchain

    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    ptx = toolchain.compile_ptx(_lower(name, toolchain.HOPPER), toolchain.HOPPER)
    assert toolchain.assemble(ptx, toolchain.HOPPER)[:4] == b"\x7fELF"
    if KERNELS[name][4]:
        assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync.aligned" not in ptx


@needs_tilelang
def test_warp_specialised_mla_splits_its_warpgroups_and_decodes_in_one_rolled_loop():
    """Consumer 0 raises its register budget, consumer 1 and the producer lower theirs; the producer
    gathers by predicated cp.async (zero-filled padding), loads its first raw bytes of a block into
    registers before waiting for a free key slot (a lane per key row: four calls' bytes in 16-byte
    loads), decodes through the ``key_decode`` functions in
    one rolled loop and meets the others on mbarriers, with one producer barrier per key block.
    Each consumer rescales its output only when a row of its warp moved its max, and walks a
    three-stage key ring (quantized rows) unrolled over its stages."""
    source = _lower("mla_sparse_ws", "sm_90a")
    producer = source[source.index("warpgroup_reg_dealloc<136>"):]
    consumers = source[source.index("warpgroup_reg_alloc<208>"):source.index("warpgroup_reg_dealloc<136>")]
    assert "warpgroup_reg_alloc<208>" in source and "warpgroup_reg_dealloc<160>" in consumers
    assert consumers.count("if (mla_rows_moved(") == 2
    assert "k_free[2].init(256)" in source and "k_free[3]" not in source and "k_free[(t % 3)].wait(" in producer
    assert "cp_async_gs_conditional<16>" in producer and "k_ready[" in producer and "k_free[" in producer
    assert producer.count("__sync_thread_partial") == 1
    assert producer.count("dk_fp8x8(") == 1 and producer.count("dk_fp4x8(") == 1
    assert producer.index("*(uint4*)(held + ") < producer.index("k_free[(t % 3)].wait(") < producer.index("dk_fp8x8(")
    assert "*(uint2*)(held + " not in producer and "*(uint*)(held + " not in producer  # whole runs, not a call each
    bf16 = _lower("mla_sparse_ws_split_bf16", "sm_90a")
    assert "mbarrier_cp_async_arrive_noinc" in bf16[bf16.index("warpgroup_reg_dealloc<96>"):]


@needs_tilelang
def test_warp_specialised_kernels_start_early_and_store_whole_vectors():
    """Sparse MLA: the key lists are read first and only the consumers copy (and wait for) the
    queries, so the producer's first gather does not queue behind them; the output leaves through
    shared memory as 16-byte vectors of consecutive addresses, not as 4-byte stores from the
    accumulator layout (those took 4-9 us a row on the H200). The bf16 grouped GEMM stores its tile
    the same way, through its weight ring; the key decode uses no float conversion instruction."""
    from deepinfer_backends.sm100.kernels import key_decode

    source = _lower("mla_sparse_ws", "sm_90a")
    producer = source[source.index("warpgroup_reg_dealloc<136>"):]
    prologue = source[:source.index("warpgroup_reg_alloc<208>")]
    assert prologue.index("main_idx[") < prologue.index("cp_async_gs<16>") < prologue.rindex("__syncthreads()")
    assert "cp_async_wait<0>" not in prologue and "cp_async_wait<0>" not in producer
    assert "if (((int)threadIdx.x) < 256) {" in prologue
    stores = [line for line in source.splitlines() if "(out + " in line and "= " in line]
    assert len(stores) == 2 and all(line.lstrip().startswith("*(uint4*)(out + ") and "q_s" in line
                                    for line in stores)
    gemm = _lower("grouped_gemm_ws", "sm_90a")
    y_stores = [line for line in gemm.splitlines() if "(y + " in line and "= " in line]
    assert y_stores and all(line.lstrip().startswith("*(uint4*)(y + ") and "w_s" in line for line in y_stores)
    assert "cvt." not in key_decode.PRELUDE and "mul.rn.bf16x2" in key_decode.PRELUDE


@needs_tilelang
def test_the_mla_trace_tool_still_finds_its_anchors_in_the_kernel():
    """``experiments/mla_trace.py`` patches a copy of ``mla_sparse_ws.py`` at anchor lines; after a
    change to the kernel its copy must still lower, with every phase stamp in place."""
    from pathlib import Path

    from deepinfer_backends.sm100 import toolchain

    path = Path(__file__).resolve().parents[2] / "experiments" / "mla_trace.py"
    spec = importlib.util.spec_from_file_location("mla_trace", path)
    mla_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mla_trace)
    mla_trace.load_traced()
    traced = sys.modules[f"deepinfer_backends.sm100.kernels.{mla_trace.TRACE_MODULE}"]
    source = toolchain.lower_source(traced.sparse_mla_ws, 64, 512, 128, 512, 512 ** -0.5)
    assert source.count("mla_clock()") == 13 + 1 and source.count("mla_dump(") == 2  # 13 stamps; definitions


@needs_tilelang
def test_warp_specialised_mla_lowers_a_budget_under_the_launch_registers_and_refuses_bad_ones():
    """A warpgroup budget under the 168 registers a thread gets at launch is lowered
    (``setmaxnreg.dec``: raising to a smaller count is an illegal instruction, as seen on the H200),
    one above it raised; budgets that are not multiples of 8 or add up to more than 504 are refused,
    and so is a producer register batch (``held_calls``) that does not divide a block's decode calls,
    and a quantized key block other than 32 rows (the decode maps a lane to a row)."""
    from deepinfer_backends.sm100 import toolchain
    from deepinfer_backends.sm100.kernels.mla_sparse_ws import sparse_mla_ws

    args = (64, 512, 128, 512, 512 ** -0.5, "fp8")
    source = toolchain.lower_source(sparse_mla_ws, *args, registers=(216, 160, 128))
    assert "warpgroup_reg_alloc<216>" in source and "warpgroup_reg_dealloc<160>" in source
    assert "warpgroup_reg_dealloc<128>" in source and "warpgroup_reg_alloc<160>" not in source
    for bad in ((216, 168, 128), (212, 160, 128), (208, 168)):
        with pytest.raises(ValueError, match="registers"):
            toolchain.lower_source(sparse_mla_ws, *args, registers=bad)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"held_calls={bad} must divide the 16 decode calls"):
            toolchain.lower_source(sparse_mla_ws, *args, held_calls=bad)
    with pytest.raises(ValueError, match="block_k=64 must be 32 with quantized rows"):
        toolchain.lower_source(sparse_mla_ws, *args, block_k=64, key_stages=2)


@needs_tilelang
def test_sparse_mla_gathers_without_a_barrier_per_copy():
    """The key lists sit in static shared memory (when they fit), which TileLang's sync pass tracks
    apart from the dynamic buffer the gathers write: no cp.async of a gather loop follows a barrier
    of its own. A list too long for static shared memory stays dynamic."""
    source = _lower("mla_sparse_decode", "sm_90a")
    assert "__shared__ __align__(16) int main_idx_s[128]" in source
    assert "__shared__ __align__(16) int extra_idx_s[512]" in source
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    copies = [i for i, line in enumerate(lines) if "cp_async_gs_conditional" in line]
    assert copies and all(lines[i - 1] != "__syncthreads();" for i in copies)
    from deepinfer_backends.sm100 import toolchain
    from deepinfer_backends.sm100.kernels.mla_sparse_decode import sparse_mla

    long_list = toolchain.lower_source(sparse_mla, 64, 512, 16384, 0, 512 ** -0.5, "bf16")
    assert "main_idx_s = ((void*)((char*)buf_dyn_shmem" in long_list


@needs_tilelang
def test_warp_specialised_grouped_gemm_keeps_one_k_block_in_flight():
    """The producer warpgroup alone issues the TMA loads; each consumer warpgroup issues one 64-row
    m64n256 wgmma chain per k-block (only while its rows hold some of the tile's rows), waits until
    at most one chain is in flight and then frees the previous block's ring slot."""
    source = _lower("grouped_gemm_ws", "sm_90a")
    producer = source[source.index("warpgroup_reg_dealloc<40>"):source.index("warpgroup_reg_alloc<232>")]
    consumer = source[source.index("warpgroup_reg_alloc<232>"):]
    assert producer.count("tl::tma_load") == 2 and "tma_load" not in consumer
    assert "wgmma_ss<tl::DataType::kBFloat16, tl::DataType::kBFloat16, tl::DataType::kFloat32, 64, 256, 16" in consumer
    live, issue, wait = consumer.index("if (live[0])"), consumer.index("wgmma_ss"), consumer.index("wait_wgmma<1>")
    assert live < issue < wait < consumer.index("empty[((kb_1 + 3) & 3)].arrive()")
    assert "wait_wgmma<0>" in consumer[wait:]


def test_bf16_grouped_gemm_kernel_is_chosen_by_arch_and_mode(monkeypatch):
    from deepinfer_backends.sm100 import gemm, toolchain

    ws = gemm.bf16_kernel(12288, 48, 4096, 4096, toolchain.HOPPER)
    assert ws == ("grouped_gemm_ws", "grouped_gemm_bf16_ws", {"block_m": 128, "block_n": 256, "num_stages": 4})
    assert gemm.bf16_kernel(192, 48, 4096, 4096, toolchain.HOPPER)[2]["block_m"] == 64
    assert gemm.bf16_kernel(40, 2, 24, 96, toolchain.HOPPER)[2]["block_n"] == 128
    assert gemm.bf16_kernel(12288, 48, 4096, 4096, toolchain.HOPPER, batch_invariant=True) == \
        ("grouped_gemm", "grouped_gemm_bf16", gemm.INVARIANT_TILES)
    assert gemm.bf16_kernel(12288, 48, 4096, 4096, toolchain.BLACKWELL) == \
        ("grouped_gemm", "grouped_gemm_bf16", gemm.gemm_tiles(12288, 48, 4096, 4096))
    monkeypatch.setattr(toolchain, "device_arch", lambda device_index=0: toolchain.BLACKWELL)
    assert gemm.bf16_kernel(12288, 48, 4096, 4096, toolchain.BLACKWELL, tcgen05=True)[:2] == \
        ("experimental.grouped_gemm_tcgen05", "grouped_gemm_bf16")


@needs_tilelang
@pytest.mark.parametrize("name", ["grouped_gemm", "mla_sparse_decode"])
def test_matrix_kernels_lower_for_blackwell_on_mma(name):
    """The portable kernels (the default on every arch) lower for sm_100a on mma.sync; the tcgen05
    variants are separate modules (tests/backends/test_sm100_tcgen05.py)."""
    from deepinfer_backends.sm100 import toolchain

    source = _lower(name, toolchain.BLACKWELL)
    assert "tl::wgmma" not in source and "tcgen05" not in source
    if name == "grouped_gemm" and toolchain.nvcc_available():
        ptx = toolchain.compile_ptx(source, toolchain.BLACKWELL)
        assert "mma.sync.aligned" in ptx and "wgmma" not in ptx


@needs_tilelang
@pytest.mark.parametrize("name", ["kv_norm_rope_store", "kv_norm_rope_store_fp4"])
def test_kv_norm_rope_store_rounds_like_the_reference(name):
    """The fp8 and fp4 store kernels' PTX: IEEE sqrt and division (torch's 1 / sqrt on a CPU), a
    saturating round-to-nearest e4m3 conversion (fp8 values, fp4 scales), and no approximate
    transcendental (scales come from bits)."""
    from deepinfer_backends.sm100 import toolchain

    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    ptx = toolchain.compile_ptx(_lower(name, toolchain.HOPPER), toolchain.HOPPER)
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

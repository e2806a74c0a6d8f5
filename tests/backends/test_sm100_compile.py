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


def test_importing_the_backend_does_not_import_tilelang():
    code = ("import sys, deepinfer_backends.sm100 as b; b.Sm100Backend().implementations(); "
            "print('tilelang' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_every_op_is_implemented_or_declined_with_a_reason():
    backend = get_backend("sm100")
    implemented, declined = set(backend.implementations()), backend.unsupported_reasons()
    assert implemented == {"grouped_gemm", "indexer_logits", "mla_sparse_decode", "mla_sparse_prefill", "rms_norm"}
    assert implemented.isdisjoint(declined)
    assert implemented | set(declined) == set(SPECS)
    assert all("reference" in reason for reason in declined.values())
    caps = backend.capabilities
    assert caps.device_types == {"cuda"} and caps.dtypes == {torch.bfloat16} and not caps.batch_invariant


def test_wrappers_refuse_inputs_they_do_not_cover():
    from deepinfer_backends.sm100.wrappers import UnsupportedInput

    ops = get_backend("sm100").implementations()
    x, w, sizes = torch.randn(4, 64), torch.randn(2, 16, 64), torch.tensor([1, 3])
    with pytest.raises(UnsupportedInput, match=r"FP8 / MXFP4 .*overrides\.grouped_gemm=reference"):
        ops["grouped_gemm"](quantize(x, "fp8"), w, sizes)
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


def test_tile_schedule_covers_each_segment_once():
    pytest.importorskip("tilelang")  # the kernel module imports it
    from deepinfer_backends.sm100.kernels.grouped_gemm import tile_schedule

    sizes = torch.tensor([0, 3, 0, 130, 64, 0])
    expert, first, end = tile_schedule(sizes, int(sizes.sum()), block_m=64).tolist()
    tiles = [(e, f, min(f + 64, n)) for e, f, n in zip(expert, first, end) if e < len(sizes)]
    assert tiles == [(1, 0, 3), (3, 3, 67), (3, 67, 131), (3, 131, 133), (4, 133, 197)]
    assert len(expert) == -(-197 // 64) + len(sizes)


KERNELS = {  # name: (kernel module, factory, args, kwargs, uses the tensor cores)
    "grouped_gemm": ("grouped_gemm", "grouped_gemm_bf16", (4, 2048, 4096), {}, True),
    "grouped_gemm_small_tiles": ("grouped_gemm", "grouped_gemm_bf16", (2, 24, 96),
                                 {"block_m": 64, "block_n": 128, "threads": 128}, True),
    "mla_sparse_decode": ("mla_sparse_decode", "sparse_mla", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}, True),
    "mla_sparse_decode_split": ("mla_sparse_decode", "sparse_mla", (128, 512, 6, 5, 512 ** -0.5, "fp8"),
                                {"splits": 2}, True),
    "mla_sparse_decode_combine": ("mla_sparse_decode", "combine", (64, 512, 4), {}, False),
    "mla_sparse_prefill": ("mla_sparse_decode", "sparse_mla", (64, 64, 8, 0, 64 ** -0.5, "bf16"), {}, True),
    "rms_norm": ("rms_norm", "rms_norm", (4096, 1e-6, "bfloat16", "bfloat16"), {"threads": 256}, False),
    "rms_norm_small": ("rms_norm", "rms_norm", (96, 1e-6, "float", None), {"threads": 32}, False),
    "indexer_logits": ("indexer_logits", "indexer_logits", (64, 128), {}, True),
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
@pytest.mark.parametrize("name", ["grouped_gemm", "mla_sparse_decode", "rms_norm", "indexer_logits"])
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
@pytest.mark.parametrize("name", ["grouped_gemm", "mla_sparse_decode"])
def test_matrix_kernels_lower_for_blackwell_on_mma(name):
    """The portable kernels lower for sm_100a; without tcgen05 variants they take mma.sync there."""
    from deepinfer_backends.sm100 import toolchain

    source = _lower(name, toolchain.BLACKWELL)
    assert "tl::wgmma" not in source and "tcgen05" not in source
    if name == "grouped_gemm" and toolchain.nvcc_available():
        ptx = toolchain.compile_ptx(source, toolchain.BLACKWELL)
        assert "mma.sync.aligned" in ptx and "wgmma" not in ptx

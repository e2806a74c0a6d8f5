"""The Blackwell tcgen05/TMEM variants of grouped_gemm and mla_sparse_decode without a GPU: each
lowers for sm_100a to tcgen05 MMAs on TMEM accumulators (no mma.sync, no wgmma) and nvcc and
ptxas accept it; and ``DEEPINFER_SM100_TCGEN05`` picks them only when set, and only on Blackwell.
No kernel runs here: their results on hardware are unverified. The kernel tests need tilelang
(``pip install -e '.[sm100]'``) and nvcc and skip with that reason where either is missing."""
import functools
import importlib
import importlib.util

import pytest
import torch

from deepinfer_backends.sm100 import toolchain

VARIANTS = {  # name: (kernel module, factory, args, kwargs)
    "grouped_gemm": ("grouped_gemm_tcgen05", "grouped_gemm_bf16", (4, 2048, 4096), {}),
    "grouped_gemm_small_tiles": ("grouped_gemm_tcgen05", "grouped_gemm_bf16", (2, 24, 96),
                                 {"block_m": 64, "block_n": 128, "threads": 128}),
    "mla_sparse_decode": ("mla_sparse_decode_tcgen05", "sparse_mla", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}),
    "mla_sparse_decode_split": ("mla_sparse_decode_tcgen05", "sparse_mla", (128, 512, 6, 5, 512 ** -0.5, "fp8"),
                                {"splits": 2}),
}


@functools.lru_cache(maxsize=None)
def _lower(name: str) -> str:
    module, factory, args, kwargs = VARIANTS[name]
    jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
    return toolchain.lower_source(jit, *args, arch=toolchain.BLACKWELL, **kwargs)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_lowers_to_tcgen05_on_tmem(name):
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    source = _lower(name)
    assert "tl::tmem_allocate" in source and "tl::tmem_deallocate" in source
    assert "tl::tcgen05mma" in source and "tl::tcgen05_ld" in source  # MMA into TMEM, read back by the threads
    assert "tl::mma_sync" not in source and "tl::wgmma" not in source


@pytest.mark.parametrize("name", ["grouped_gemm", "mla_sparse_decode"])
def test_variant_compiles_for_blackwell(name):
    """nvcc makes PTX of the generated source for sm_100a and ptxas assembles it; the PTX holds
    the tcgen05 MMA and TMEM instructions and no older tensor-core path."""
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    if not toolchain.nvcc_available():
        pytest.skip("nvcc is not on the PATH")
    ptx = toolchain.compile_ptx(_lower(name), toolchain.BLACKWELL)
    for instruction in ("tcgen05.alloc", "tcgen05.mma", "tcgen05.commit", "tcgen05.ld", "tcgen05.dealloc"):
        assert instruction in ptx, instruction
    assert "mma.sync.aligned" not in ptx and "wgmma" not in ptx
    assert toolchain.assemble(ptx, toolchain.BLACKWELL)[:4] == b"\x7fELF"


def _arch(monkeypatch, arch: str | None) -> None:
    """Pretend the device is ``arch`` (``None``: fail if the arch is looked up at all)."""
    def device_arch(device_index: int = 0) -> str:
        if arch is None:
            pytest.fail("the device arch was looked up with the tcgen05 switch off")
        return arch

    monkeypatch.setattr(toolchain, "device_arch", device_arch)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_switch_off_keeps_the_portable_kernels(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(toolchain.TCGEN05_SWITCH, raising=False)
    else:
        monkeypatch.setenv(toolchain.TCGEN05_SWITCH, value)
    _arch(monkeypatch, None)
    assert toolchain.kernel_module("grouped_gemm", "grouped_gemm") == "grouped_gemm"
    assert toolchain.kernel_module("mla_sparse_decode", "mla_sparse_decode") == "mla_sparse_decode"


def test_switch_on_blackwell_selects_the_tcgen05_kernels(monkeypatch):
    monkeypatch.setenv(toolchain.TCGEN05_SWITCH, "1")
    _arch(monkeypatch, toolchain.BLACKWELL)
    assert toolchain.kernel_module("grouped_gemm", "grouped_gemm") == "grouped_gemm_tcgen05"
    assert toolchain.kernel_module("mla_sparse_decode", "mla_sparse_decode") == "mla_sparse_decode_tcgen05"
    assert toolchain.kernel_module("mla_sparse_prefill", "mla_sparse_decode") == "mla_sparse_decode"
    for module in toolchain.TCGEN05_VARIANTS.values():
        assert importlib.util.find_spec(f"deepinfer_backends.sm100.kernels.{module}") is not None


def test_switch_on_hopper_raises(monkeypatch):
    monkeypatch.setenv(toolchain.TCGEN05_SWITCH, "1")
    _arch(monkeypatch, toolchain.HOPPER)
    with pytest.raises(RuntimeError, match=r"DEEPINFER_SM100_TCGEN05=1 selects the tcgen05/TMEM kernel for "
                                           r"grouped_gemm, which needs Blackwell \(sm_100a\); this device is sm_90a"):
        toolchain.kernel_module("grouped_gemm", "grouped_gemm")
    monkeypatch.setenv(toolchain.TCGEN05_SWITCH, "yes")
    with pytest.raises(ValueError, match=r"DEEPINFER_SM100_TCGEN05='yes': expected 1"):
        toolchain.kernel_module("grouped_gemm", "grouped_gemm")


@pytest.mark.parametrize("switch, arch, kernel", [
    ("0", toolchain.BLACKWELL, ("mla_sparse_decode", "sparse_mla")),
    ("0", toolchain.HOPPER, ("mla_sparse_ws", "sparse_mla_ws")),
    ("1", toolchain.BLACKWELL, ("mla_sparse_decode_tcgen05", "sparse_mla")),
    ("1", toolchain.HOPPER, None)])
def test_mla_sparse_decode_wrapper_follows_the_switch(monkeypatch, switch, arch, kernel):
    """The wrapper asks the switch at dispatch (its CUDA check and the compile are stubbed out); with
    the switch off, Blackwell keeps the portable kernel and Hopper runs the warp-specialised one."""
    from deepinfer_backends.sm100 import attention, wrappers

    monkeypatch.setenv(toolchain.TCGEN05_SWITCH, switch)
    _arch(monkeypatch, arch)
    compiled = []
    monkeypatch.setattr(attention, "cuda_bf16", lambda *args: None)
    monkeypatch.setattr(attention, "compiled", lambda *args, **kwargs: compiled.append(args[:2]) or (lambda *t: None))
    args = (torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 528, dtype=torch.uint8),
            torch.zeros(1, 1, 64, dtype=torch.int32), torch.zeros(64), 512 ** -0.5)
    monkeypatch.delenv(toolchain.MLA_PORTABLE_SWITCH, raising=False)
    if kernel is None:
        with pytest.raises(RuntimeError, match="needs Blackwell"):
            wrappers.mla_sparse_decode(*args, split_kv=False)
        return
    wrappers.mla_sparse_decode(*args, split_kv=False)
    assert compiled == [kernel]

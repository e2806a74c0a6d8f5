"""The Blackwell tcgen05/TMEM variants of grouped_gemm and mla_sparse_decode without a GPU: each
compiles for sm_100a (``cubin_checks``) to tcgen05 MMAs into TMEM read back by the threads (no
mma.sync, no wgmma), within a CTA's limits; and ``backend.options.tcgen05`` picks them only when
set, and only on Blackwell.
No kernel runs here: their results on hardware are unverified. The kernel tests need tilelang
(``pip install -e '.[sm100]'``) and nvcc and skip with that reason where either is missing."""
import functools
import importlib
import importlib.util

import pytest
import torch

from deepinfer_backends.sm100 import toolchain
from deepinfer_backends.sm100.options import KernelOptions
from tests.backends import cubin_checks

VARIANTS = {  # name: (kernel module, factory, args, kwargs)
    "grouped_gemm": ("experimental.grouped_gemm_tcgen05", "grouped_gemm_bf16", (4, 2048, 4096), {}),
    "grouped_gemm_small_tiles": ("experimental.grouped_gemm_tcgen05", "grouped_gemm_bf16", (2, 24, 96),
                                 {"block_m": 64, "block_n": 128, "threads": 128}),
    "mla_sparse_decode": ("experimental.mla_sparse_decode_tcgen05", "sparse_mla", (64, 512, 128, 512, 512 ** -0.5, "fp8"), {}),
    "mla_sparse_decode_split": ("experimental.mla_sparse_decode_tcgen05", "sparse_mla", (128, 512, 6, 5, 512 ** -0.5, "fp8"),
                                {"splits": 2}),
}
SPILLS = {"mla_sparse_decode"}
"""Variants ptxas is known to spill registers in."""


@functools.lru_cache(maxsize=None)
def _compile(name: str) -> cubin_checks.Cubin:
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    module, factory, args, kwargs = VARIANTS[name]
    jit = getattr(importlib.import_module(f"deepinfer_backends.sm100.kernels.{module}"), factory)
    return cubin_checks.compile_cubin(cubin_checks.lower(jit, *args, arch=toolchain.BLACKWELL, **kwargs))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_compiles_to_tcgen05_on_tmem(name):
    """nvcc and ptxas accept the variant for sm_100a, within a CTA's limits; its SASS allocates and
    frees TMEM (UTCATOMSWS), issues tcgen05 MMAs into it (UTC*MMA), commits them to a barrier
    (UTCBAR), reads the accumulators back into registers (LDTM), and holds no older tensor-core
    path (HMMA, HGMMA)."""
    cubin = _compile(name)
    cubin_checks.assert_fits(cubin)
    opcodes = {line.split()[0].split(".")[0] for line in cubin.sass}
    assert any(op.startswith("UTC") and op.endswith("MMA") for op in opcodes), sorted(opcodes)
    assert {"UTCBAR", "LDTM"} <= opcodes and "UTCATOMSWS" in opcodes
    assert not {"HMMA", "HGMMA"} & opcodes


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=f"ptxas spills registers in {n}"))
                                  if n in SPILLS else n for n in sorted(VARIANTS)])
def test_variant_keeps_its_values_in_registers(name):
    cubin_checks.assert_no_spill(_compile(name))


def _arch(monkeypatch, arch: str | None) -> None:
    """Pretend the device is ``arch`` (``None``: fail if the arch is looked up at all)."""
    def device_arch(device_index: int = 0) -> str:
        if arch is None:
            pytest.fail("the device arch was looked up with tcgen05 off")
        return arch

    monkeypatch.setattr(toolchain, "device_arch", device_arch)


def test_option_off_keeps_the_portable_kernels(monkeypatch):
    _arch(monkeypatch, None)
    assert toolchain.kernel_module("grouped_gemm", "grouped_gemm") == "grouped_gemm"
    assert toolchain.kernel_module("mla_sparse_decode", "mla_sparse_decode", tcgen05=False) == "mla_sparse_decode"


def test_option_on_blackwell_selects_the_tcgen05_kernels(monkeypatch):
    _arch(monkeypatch, toolchain.BLACKWELL)
    assert toolchain.kernel_module("grouped_gemm", "grouped_gemm", True) == "experimental.grouped_gemm_tcgen05"
    assert toolchain.kernel_module("mla_sparse_decode", "mla_sparse_decode", True) == \
        "experimental.mla_sparse_decode_tcgen05"
    assert toolchain.kernel_module("mla_sparse_prefill", "mla_sparse_decode", True) == "mla_sparse_decode"
    for module in toolchain.TCGEN05_VARIANTS.values():
        assert importlib.util.find_spec(f"deepinfer_backends.sm100.kernels.{module}") is not None


def test_option_on_hopper_raises(monkeypatch):
    _arch(monkeypatch, toolchain.HOPPER)
    with pytest.raises(RuntimeError, match=r"backend.options.tcgen05=true selects the tcgen05/TMEM kernel for "
                                           r"grouped_gemm, which needs Blackwell \(sm_100a\); this device is sm_90a"):
        toolchain.kernel_module("grouped_gemm", "grouped_gemm", tcgen05=True)
    with pytest.raises(ValueError, match=r"backend.options.tcgen05='yes': expected true or false"):
        KernelOptions(tcgen05="yes")


@pytest.mark.parametrize("tcgen05, arch, kernel", [
    (False, toolchain.BLACKWELL, ("mla_sparse_decode", "sparse_mla")),
    (False, toolchain.HOPPER, ("mla_sparse_ws", "sparse_mla_ws")),
    (True, toolchain.BLACKWELL, ("experimental.mla_sparse_decode_tcgen05", "sparse_mla")),
    (True, toolchain.HOPPER, None)])
def test_the_backends_mla_sparse_decode_follows_its_options(monkeypatch, tcgen05, arch, kernel):
    """The op table's ``mla_sparse_decode`` of an sm100 backend built with ``backend.options``
    (its CUDA check and the compile are stubbed out); with ``tcgen05`` off, Blackwell keeps the
    portable kernel and Hopper runs the warp-specialised one."""
    from deepinfer.hal.registry import get_backend
    from deepinfer_backends.sm100 import attention

    _arch(monkeypatch, arch)
    compiled = []
    monkeypatch.setattr(attention, "cuda_bf16", lambda *args: None)
    monkeypatch.setattr(attention, "compiled", lambda *args, **kwargs: compiled.append(args[:2]) or (lambda *t: None))
    args = (torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16), torch.zeros(4, 528, dtype=torch.uint8),
            torch.zeros(1, 1, 64, dtype=torch.int32), torch.zeros(64), 512 ** -0.5)
    decode = get_backend("sm100", {"tcgen05": tcgen05}).implementations()["mla_sparse_decode"]
    if kernel is None:
        with pytest.raises(RuntimeError, match="needs Blackwell"):
            decode(*args, split_kv=False)
        return
    decode(*args, split_kv=False)
    assert compiled == [kernel]

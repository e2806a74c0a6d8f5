"""Lowering and compiling TileLang kernels for a named GPU arch without a GPU (CPU tests, CI).

``import tilelang`` costs seconds, so this module imports it only inside its functions."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

HOPPER = "sm_90a"
BLACKWELL = "sm_100a"
TCGEN05_VARIANTS = {"grouped_gemm": "experimental.grouped_gemm_tcgen05",
                    "mla_sparse_decode": "experimental.mla_sparse_decode_tcgen05"}
"""Ops with a Blackwell tcgen05/TMEM kernel (op -> kernels module). Compiled for sm_100a but never
run on hardware, so they serve only with ``backend.options.tcgen05=true`` (:func:`kernel_module`)."""


def device_arch(device_index: int = 0) -> str:
    """The TileLang arch token of a CUDA device: ``sm_90a`` on Hopper, ``sm_100a`` on Blackwell.

    The ``a`` targets are needed for wgmma (sm_90a) and tcgen05 (sm_100a); plain ``sm_90`` makes
    nvcc reject the warpgroup instructions TileLang emits."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        raise RuntimeError(f"the sm100 backend needs compute capability 9.0 or newer (Hopper, Blackwell); "
                           f"device {device_index} has {major}.{minor}. Use backend=reference on this GPU")
    return f"sm_{major}{minor}a"


def kernel_module(op: str, portable: str, tcgen05: bool = False) -> str:
    """The kernels module that runs ``op``: ``portable`` (the default on every arch), or with
    ``tcgen05`` (``backend.options.tcgen05``) the op's tcgen05/TMEM variant
    (:data:`TCGEN05_VARIANTS`). With ``tcgen05``, an op that has a variant needs a Blackwell
    (sm_100a) device: on any other this raises instead of quietly running the portable kernel."""
    if op not in TCGEN05_VARIANTS or not tcgen05:
        return portable
    arch = device_arch()
    if arch != BLACKWELL:
        raise RuntimeError(f"backend.options.tcgen05=true selects the tcgen05/TMEM kernel for {op}, which needs "
                           f"Blackwell ({BLACKWELL}); this device is {arch}. Set backend.options.tcgen05=false to "
                           f"run the portable kernels")
    return TCGEN05_VARIANTS[op]


def target(arch: str):
    """A TVM CUDA target for ``arch`` (e.g. ``"sm_90a"``)."""
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": arch})


def lower_source(factory, *args, arch: str = HOPPER, **kwargs) -> str:
    """CUDA source TileLang generates for ``factory(*args, **kwargs)`` (a ``@tilelang.jit`` kernel
    factory) on ``arch``, with the factory's own pass configs. Needs no GPU."""
    import tilelang
    import tvm

    func = factory.get_tir(*args, **kwargs)
    pass_configs = getattr(factory, "pass_configs", None) or {}
    tgt = target(arch)
    with tvm.transform.PassContext(opt_level=3, config=pass_configs), tgt:
        artifact = tilelang.lower(func, target=tgt)
    return artifact.kernel_source


def nvcc_available() -> bool:
    """Whether ``nvcc`` is on the PATH (needed by :func:`compile_cubin`)."""
    return shutil.which("nvcc") is not None


def compile_ptx(source: str, arch: str = HOPPER) -> str:
    """PTX that nvcc makes of TileLang-generated CUDA source for ``arch`` (no GPU needed)."""
    from tilelang.contrib import nvcc

    number = arch.removeprefix("sm_")
    gencode = ["-gencode", f"arch=compute_{number},code=compute_{number}"]
    ptx = nvcc.compile_cuda(source, target_format="ptx", arch=gencode, options=nvcc.default_compile_options())
    return ptx.decode() if isinstance(ptx, (bytes, bytearray)) else ptx


def assemble(ptx: str, arch: str = HOPPER) -> bytes:
    """Machine code (a cubin) that ptxas makes of ``ptx`` for ``arch``; raises with ptxas's
    message when it rejects the code (e.g. wgmma on a target without the ``a`` suffix)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([_ptxas(), f"-arch={arch}", "-O3", src, "-o", out], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas rejected the kernel for {arch}:\n{done.stderr}")
        with open(out, "rb") as f:
            return f.read()


def _ptxas() -> str:
    from tilelang.contrib.nvcc import find_cuda_path

    return shutil.which("ptxas") or os.path.join(find_cuda_path(), "bin", "ptxas")

"""What a TileLang kernel becomes on a GPU arch, measured without a GPU: the launch TileLang plans
for it (threads, dynamic shared memory) and, from the cubin ptxas makes of it, its registers,
spills, static shared memory and SASS. Tests use it to check that a kernel fits the arch and runs
on the instructions meant for it; the GPU tests check its results.

Each step skips its test with the reason where its tool is missing: tilelang to lower, nvcc and
ptxas to compile, cuobjdump (CUDA toolkit, or the copy triton ships) to read the SASS."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

REGISTER_FILE = 65536
"""32-bit registers of one SM: the most the threads of one CTA can hold (sm_90, sm_100)."""
MAX_THREADS = 1024
MAX_SHARED = {"sm_90a": 227 * 1024, "sm_100a": 227 * 1024}
"""Shared memory one CTA may use, static and dynamic together (CUDA C++ Programming Guide,
technical specifications by compute capability: 9.0 and 10.0)."""
MAX_STATIC_SHARED = 48 * 1024


@dataclass(frozen=True)
class Lowered:
    """A kernel's CUDA source for ``arch`` and the launch TileLang plans for it."""

    source: str
    arch: str
    threads: int
    dynamic_shared: int


@dataclass(frozen=True)
class Cubin:
    """A compiled kernel: its launch, ptxas's resource report and its SASS, one instruction a line
    (opcode with modifiers, then operands; predicates dropped)."""

    arch: str
    threads: int
    dynamic_shared: int
    registers: int
    spilled: int
    static_shared: int
    report: str
    ptx: str
    sass: tuple[str, ...]

    def count(self, opcode: str) -> int:
        """Instructions whose opcode is ``opcode`` or starts with ``opcode.``."""
        return sum(1 for line in self.sass if line.split()[0] == opcode or line.startswith(opcode + "."))

    def register_budgets(self) -> list[tuple[str, int]]:
        """``(ALLOC or DEALLOC, registers)`` of each ``setmaxnreg`` in the SASS."""
        budgets = []
        for line in self.sass:
            if line.startswith("USETMAXREG."):
                direction = "DEALLOC" if ".DEALLOC" in line.split()[0] else "ALLOC"
                budgets.append((direction, int(line.split()[-1], 16)))
        return budgets


def lower(factory, *args, arch: str = "sm_90a", **kwargs) -> Lowered:
    """``factory(*args, **kwargs)`` (a ``@tilelang.jit`` kernel factory) lowered for ``arch`` with
    the factory's pass configs, as ``toolchain.lower_source`` does, keeping the planned launch."""
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install -e '.[sm100]')")
    import tilelang
    import tvm

    from deepinfer_backends.sm100 import toolchain

    target = toolchain.target(arch)
    with tvm.transform.PassContext(opt_level=3, config=getattr(factory, "pass_configs", None) or {}), target:
        artifact = tilelang.lower(factory.get_tir(*args, **kwargs), target=target)
    kernels = [f for f in artifact.device_mod.functions.values() if "thread_extent" in f.attrs]
    assert len(kernels) == 1, f"expected one kernel, lowered {len(kernels)}"
    extent, threads = kernels[0].attrs["thread_extent"], 1
    for axis in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
        threads *= int(extent[axis]) if axis in extent else 1
    dynamic = kernels[0].attrs.get("dyn_shared_memory_buf")
    return Lowered(artifact.kernel_source, arch, threads, int(dynamic) if dynamic is not None else 0)


@functools.lru_cache(maxsize=None)
def compile_cubin(kernel: Lowered) -> Cubin:
    """nvcc's PTX of ``kernel``, assembled by ``ptxas -v`` for its arch and disassembled."""
    from deepinfer_backends.sm100 import toolchain

    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    ptx = toolchain.compile_ptx(kernel.source, kernel.arch)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, f"-arch={kernel.arch}", "-O3", "-v", src, "-o", out],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"ptxas rejected the kernel for {kernel.arch}:\n{done.stderr}"
        sass = subprocess.run([cuobjdump, "-sass", out], capture_output=True, text=True, check=True).stdout
    report = done.stdout + done.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    static = re.search(r"(\d+) bytes smem", report)
    return Cubin(kernel.arch, kernel.threads, kernel.dynamic_shared,
                 registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                 spilled=int(spills.group(1)) + int(spills.group(2)),
                 static_shared=int(static.group(1)) if static else 0, report=report, ptx=ptx,
                 sass=tuple(m.group(1).strip() for m in re.finditer(
                     r"/\*[0-9a-f]{4,}\*/\s+(?:@!?\w+\s+)?([A-Z][^;]*);", sass)))


def assert_launch_fits(kernel: Lowered | Cubin) -> None:
    """The planned launch is one a CTA of the arch can take: threads and dynamic shared memory."""
    assert 0 < kernel.threads <= MAX_THREADS, f"{kernel.threads} threads a CTA"
    assert kernel.dynamic_shared <= MAX_SHARED[kernel.arch], \
        f"{kernel.dynamic_shared} bytes of dynamic shared memory, over {MAX_SHARED[kernel.arch]} on {kernel.arch}"


def assert_fits(cubin: Cubin) -> None:
    """The compiled kernel can launch: its registers (allocated in 8s a thread) for all its threads
    fit the register file, its static and dynamic shared memory the arch's limit, and each
    ``setmaxnreg`` moves a warpgroup in the legal direction from the launch count (raising to
    fewer registers, or lowering to more, is an illegal instruction)."""
    assert_launch_fits(cubin)
    held = -(-cubin.registers // 8) * 8 * cubin.threads
    assert held <= REGISTER_FILE, f"{cubin.registers} registers x {cubin.threads} threads = {held}\n{cubin.report}"
    shared = cubin.static_shared + cubin.dynamic_shared
    assert cubin.static_shared <= MAX_STATIC_SHARED and shared <= MAX_SHARED[cubin.arch], \
        f"{cubin.static_shared} + {cubin.dynamic_shared} bytes of shared memory on {cubin.arch}"
    for direction, count in cubin.register_budgets():
        legal = count <= cubin.registers if direction == "DEALLOC" else count >= cubin.registers
        assert legal, f"setmaxnreg {direction} to {count} from {cubin.registers} launch registers"


def assert_no_spill(cubin: Cubin) -> None:
    """ptxas kept every value in registers (no spill stores or loads to local memory)."""
    assert cubin.spilled == 0, f"ptxas spilled {cubin.spilled} bytes:\n{cubin.report}"


def _tool(name: str) -> str:
    """Path of a CUDA tool: on the PATH, beside nvcc, or (cuobjdump) the copy triton ships."""
    if not shutil.which("nvcc"):
        pytest.skip("nvcc is not on the PATH")
    found = shutil.which(name) or os.path.join(os.path.dirname(os.path.realpath(shutil.which("nvcc"))), name)
    if not os.path.exists(found) and importlib.util.find_spec("triton") is not None:
        triton = importlib.util.find_spec("triton").submodule_search_locations[0]
        found = os.path.join(triton, "backends", "nvidia", "bin", name)
    if not os.path.exists(found):
        pytest.skip(f"{name} is not installed (CUDA toolkit, or pip install triton for cuobjdump)")
    return found

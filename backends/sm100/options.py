"""The sm100 backend's kernel choices (``backend.options`` when ``backend.name=sm100``)."""
from __future__ import annotations

from dataclasses import dataclass

MLA_KERNELS = ("auto", "warp_specialized", "portable")
LINEAR_KERNELS = ("auto", "tilelang", "cublas")


@dataclass(frozen=True)
class KernelOptions:
    """Which kernel serves an op where the sm100 backend has more than one."""

    mla_kernel: str = "auto"
    """Sparse MLA, decode and prefill: ``auto`` (the warp-specialised kernel on Hopper, the
    portable one elsewhere), ``warp_specialized`` (Hopper only), or ``portable`` (every arch)."""
    linear_kernel: str = "auto"
    """Dense bf16 ``linear`` and ``stacked_linear``: ``auto`` (up to 16 rows the Triton kernel for
    few rows, one launch for every weight of a ``stacked_linear``; cuBLAS, through
    ``torch.nn.functional.linear``, above: on few rows the TileLang GEMM's 64- and 128-row tiles
    leave the weight stream short of the memory bandwidth, and on a prefill's thousands of rows
    cuBLAS's kernels run ahead of it, ``experiments/results/prefill_h100.md``),
    ``tilelang`` (always the TileLang GEMM) or ``cublas`` (always cuBLAS). Block-scaled weights always take the TileLang
    kernel, and so does every row count in batch-invariant mode (cuBLAS picks its kernel by
    shape); ``cublas`` is refused there. ``grouped_linear`` follows the choice: cuBLAS's strided
    batched GEMM at every row count unless ``tilelang``."""
    tcgen05: bool = False
    """The Blackwell tcgen05/TMEM variants of the bf16 grouped GEMM and of sparse MLA decode
    (``kernels/experimental/``: compiled for sm_100a, never run on hardware). They need a
    Blackwell device: on any other those ops raise rather than quietly run another kernel."""

    def __post_init__(self) -> None:
        if self.mla_kernel not in MLA_KERNELS:
            raise ValueError(f"backend.options.mla_kernel={self.mla_kernel!r}: expected one of {list(MLA_KERNELS)}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"backend.options.linear_kernel={self.linear_kernel!r}: expected one of "
                             f"{list(LINEAR_KERNELS)}")
        if not isinstance(self.tcgen05, bool):
            raise ValueError(f"backend.options.tcgen05={self.tcgen05!r}: expected true or false")


DEFAULT = KernelOptions()

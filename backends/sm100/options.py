"""The sm100 backend's kernel choices (``backend.options`` when ``backend.name=sm100``)."""
from __future__ import annotations

from dataclasses import dataclass

MLA_KERNELS = ("auto", "warp_specialized", "portable")


@dataclass(frozen=True)
class KernelOptions:
    """Which kernel serves an op where the sm100 backend has more than one."""

    mla_kernel: str = "auto"
    """Sparse MLA, decode and prefill: ``auto`` (the warp-specialised kernel on Hopper, the
    portable one elsewhere), ``warp_specialized`` (Hopper only), or ``portable`` (every arch)."""
    tcgen05: bool = False
    """The Blackwell tcgen05/TMEM variants of the bf16 grouped GEMM and of sparse MLA decode
    (``kernels/experimental/``: compiled for sm_100a, never run on hardware). They need a
    Blackwell device: on any other those ops raise rather than quietly run another kernel."""

    def __post_init__(self) -> None:
        if self.mla_kernel not in MLA_KERNELS:
            raise ValueError(f"backend.options.mla_kernel={self.mla_kernel!r}: expected one of {list(MLA_KERNELS)}")
        if not isinstance(self.tcgen05, bool):
            raise ValueError(f"backend.options.tcgen05={self.tcgen05!r}: expected true or false")


DEFAULT = KernelOptions()

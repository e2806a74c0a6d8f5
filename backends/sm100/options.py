"""The sm100 backend's kernel choices (``backend.options`` when ``backend.name=sm100``)."""
from __future__ import annotations

from dataclasses import dataclass

MLA_KERNELS = ("auto", "warp_specialized", "portable")
LINEAR_KERNELS = ("auto", "tilelang", "cublas")
QUANT_GEMMS = ("exact", "native")


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
    quant_gemm: str = "exact"
    """Block-scaled ``grouped_gemm`` with FP8 activations: ``exact`` (decoded exactly to bf16 and
    multiplied on the bf16 tensor cores: the reference's numbers up to the float32 summation
    order) or ``native`` (on Hopper, the FP8 tensor cores: activation scales moved to one per 128
    along K and weight scales to one per output column, DeepGEMM's SM90 promotion every 128
    values of K; ``kernels/grouped_gemm_fp8_k128.py``). ``native`` adds the FP8
    tensor cores' accumulation error, a few 1e-4 of the largest output, and the rounding of
    values that the moved scales push below e4m3's normal range, 2^-10 of the new scale at most;
    bf16 activations, few rows per expert, other archs and the batch-invariant mode keep
    ``exact``."""
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
        if self.quant_gemm not in QUANT_GEMMS:
            raise ValueError(f"backend.options.quant_gemm={self.quant_gemm!r}: expected one of {list(QUANT_GEMMS)}")
        if not isinstance(self.tcgen05, bool):
            raise ValueError(f"backend.options.tcgen05={self.tcgen05!r}: expected true or false")


DEFAULT = KernelOptions()

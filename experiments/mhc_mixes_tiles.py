"""The two mHC mixes kernels of sm100 (``fused/mhc_mixes.py``) timed apart, over their tiles, at
model=small's width (4 streams of 4096) for a decode and a prefill token count: the partial dot
products (tokens a program, slice width) and the finishing kernel (tokens a program, warps).

    python experiments/mhc_mixes_tiles.py [study.tokens=[1,64,8192]] [study.output_dir=DIR] [overrides...]

Per point: the kernel's time (CUDA-graph replay, median of 5 rounds) and, for the partials, the
residual bytes it reads per second as a share of the copy bandwidth (bytes read and written per
second) measured in the same run.
Prints a table and writes ``mhc_mixes_tiles_<card>.csv`` under ``experiments/results/`` or ``study.output_dir``."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings, timed  # noqa: E402

STREAMS, HIDDEN, ITERS, ROWS = 4, 4096, 20, 32
MIXES, WIDTH = STREAMS * (2 + STREAMS), STREAMS * HIDDEN
PARTIAL_TILES = [(32, 256), (32, 512), (64, 256), (64, 512), (128, 512), (16, 256), (16, 128)]
"""(tokens a program, slice width) of ``mhc_mix_partials``."""
FINISH_TILES = [(32, 4), (8, 4), (2, 1), (4, 1), (8, 2), (16, 4)]
"""(tokens a program, warps) of ``mhc_mixes_kernel``."""


@dataclass
class Settings(StudySettings):
    """The token counts timed."""

    FAST = ("study.tokens=[1,64]",)
    DEVICE = "cuda"

    tokens: list[int] = field(default_factory=lambda: [1, 64, 8192])
    """Token counts (rows of the flattened residual)."""


def time_partials(kernels, tokens: int, parts: torch.Tensor, copy: float, g) -> list[dict]:
    """``mhc_mix_partials`` at each of :data:`PARTIAL_TILES` on ``tokens`` random bf16 rows."""
    x = torch.randn(tokens, WIDTH, device="cuda", generator=g).to(torch.bfloat16)
    out = []
    for block, split in PARTIAL_TILES:
        splits = -(-WIDTH // split)
        dots = torch.empty(splits, tokens, ROWS, device="cuda")
        squares = torch.empty(splits, tokens, device="cuda")

        def partials():
            kernels.mhc_mix_partials[(-(-tokens // block), splits)](
                x, parts, dots, squares, tokens, WIDTH, MIXES, WIDTH, ROWS=ROWS, BLOCK=block, SPLIT=split,
                BLOCK_K=kernels.BLOCK_K, PARTS=3, UPCAST=False, num_warps=4)
        seconds, _ = timed(partials)
        row = {"kernel": "mhc_mix_partials", "tokens": tokens, "block_tokens": block, "split": split, "warps": 4,
               "time_us": round(seconds * 1e6, 2), "frac_copy": round(x.nbytes / seconds / copy, 3)}
        out.append(row)
        print(f"partials T={tokens:<5} block {block:<3} split {split:<4} {row['time_us']:8.1f} us "
              f"({row['frac_copy']:.2f} of copy bw)", flush=True)
    return out


def time_finish(kernels, tokens: int, g) -> list[dict]:
    """``mhc_mixes_kernel`` at each of :data:`FINISH_TILES` on random partials of ``tokens`` tokens."""
    splits = -(-WIDTH // kernels.SPLIT)
    dots = torch.randn(splits, tokens, ROWS, device="cuda", generator=g)
    squares = torch.rand(splits, tokens, device="cuda", generator=g) + 1
    scale, base = torch.ones(3, device="cuda"), torch.zeros(MIXES, device="cuda")
    pre = torch.empty(tokens, STREAMS, device="cuda")
    post, comb = torch.empty_like(pre), torch.empty(tokens, STREAMS, STREAMS, device="cuda")
    out = []
    for block, warps in FINISH_TILES:
        def finish():
            kernels.mhc_mixes_kernel[(-(-tokens // block),)](
                dots, squares, scale, base, pre, post, comb, tokens, WIDTH, 1e-6, 1e-6, SPLITS=splits, HC=STREAMS,
                ROWS=ROWS, ITERS=ITERS, BLOCK=block, num_warps=warps)
        seconds, _ = timed(finish)
        row = {"kernel": "mhc_mixes_kernel", "tokens": tokens, "block_tokens": block, "split": kernels.SPLIT,
               "warps": warps, "time_us": round(seconds * 1e6, 2), "frac_copy": ""}
        out.append(row)
        print(f"finish   T={tokens:<5} block {block:<3} warps {warps}  {row['time_us']:8.1f} us", flush=True)
    return out


def main(argv=None) -> int:
    from deepinfer_backends.sm100.fused import mhc_mixes as kernels

    _, settings = compose_study("mhc_mixes_tiles", Settings, argv)
    card = torch.cuda.get_device_name().replace(" ", "_")
    copy = ceilings()["copy_bw"]
    g = torch.Generator("cuda").manual_seed(0)
    parts = kernels.bf16_parts(torch.randn(MIXES, WIDTH, device="cuda", generator=g) * 1e-2)
    rows = []
    for tokens in settings.tokens:
        rows += time_partials(kernels, tokens, parts, copy, g) + time_finish(kernels, tokens, g)
    print("wrote", write_results(settings.results_path(f"mhc_mixes_tiles_{card.split('_')[-1].lower()}"), rows,
                                 study_command("mhc_mixes_tiles", argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

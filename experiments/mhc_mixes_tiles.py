"""The two mHC mixes kernels of sm100 (``fused/mhc_mixes.py``) timed apart, over their tiles, at
model=small's width (4 streams of 4096) for a decode and a prefill token count: the partial dot
products (tokens a program, slice width) and the finishing kernel (tokens a program, warps).

    python experiments/mhc_mixes_tiles.py [--tokens 1 64 8192] [--out DIR]

Per point: the kernel's time (CUDA-graph replay, median of 5 rounds) and, for the partials, the
residual bytes it reads per second as a share of the copy bandwidth (bytes read and written per
second) measured in the same run.
Prints a table and writes ``mhc_mixes_tiles_<card>.csv`` under ``experiments/results/`` or ``--out``."""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import RESULTS, ceilings, timed, write_csv  # noqa: E402

STREAMS, HIDDEN, ITERS = 4, 4096, 20
PARTIAL_TILES = [(32, 256), (32, 512), (64, 256), (64, 512), (128, 512), (16, 256), (16, 128)]
"""(tokens a program, slice width) of ``mhc_mix_partials``."""
FINISH_TILES = [(32, 4), (8, 4), (2, 1), (4, 1), (8, 2), (16, 4)]
"""(tokens a program, warps) of ``mhc_mixes_kernel``."""
FIELDS = ("card", "date", "command", "kernel", "tokens", "block_tokens", "split", "warps", "time_us", "frac_copy")


def main() -> None:
    from deepinfer_backends.sm100.fused import mhc_mixes as kernels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    card = torch.cuda.get_device_name().replace(" ", "_")
    stamp = {"card": card, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": " ".join(["python", *sys.argv])}
    copy = ceilings()["copy_bw"]
    g = torch.Generator("cuda").manual_seed(0)
    mixes, width, rows = STREAMS * (2 + STREAMS), STREAMS * HIDDEN, 32
    parts = kernels.bf16_parts(torch.randn(mixes, width, device="cuda", generator=g) * 1e-2)
    scale, base = torch.ones(3, device="cuda"), torch.zeros(mixes, device="cuda")
    out = []
    for tokens in args.tokens:
        x = torch.randn(tokens, width, device="cuda", generator=g).to(torch.bfloat16)
        for block, split in PARTIAL_TILES:
            splits = -(-width // split)
            dots = torch.empty(splits, tokens, rows, device="cuda")
            squares = torch.empty(splits, tokens, device="cuda")

            def partials():
                kernels.mhc_mix_partials[(-(-tokens // block), splits)](
                    x, parts, dots, squares, tokens, width, mixes, width, ROWS=rows, BLOCK=block, SPLIT=split,
                    BLOCK_K=kernels.BLOCK_K, PARTS=3, UPCAST=False, num_warps=4)
            seconds, _ = timed(partials)
            row = {**stamp, "kernel": "mhc_mix_partials", "tokens": tokens, "block_tokens": block, "split": split,
                   "warps": 4, "time_us": round(seconds * 1e6, 2), "frac_copy": round(x.nbytes / seconds / copy, 3)}
            out.append(row)
            print(f"partials T={tokens:<5} block {block:<3} split {split:<4} {row['time_us']:8.1f} us "
                  f"({row['frac_copy']:.2f} of copy bw)", flush=True)
        splits = -(-width // kernels.SPLIT)
        dots = torch.randn(splits, tokens, rows, device="cuda", generator=g)
        squares = torch.rand(splits, tokens, device="cuda", generator=g) + 1
        pre = torch.empty(tokens, STREAMS, device="cuda")
        post, comb = torch.empty_like(pre), torch.empty(tokens, STREAMS, STREAMS, device="cuda")
        for block, warps in FINISH_TILES:
            def finish():
                kernels.mhc_mixes_kernel[(-(-tokens // block),)](
                    dots, squares, scale, base, pre, post, comb, tokens, width, 1e-6, 1e-6, SPLITS=splits, HC=STREAMS,
                    ROWS=rows, ITERS=ITERS, BLOCK=block, num_warps=warps)
            seconds, _ = timed(finish)
            row = {**stamp, "kernel": "mhc_mixes_kernel", "tokens": tokens, "block_tokens": block,
                   "split": kernels.SPLIT, "warps": warps, "time_us": round(seconds * 1e6, 2), "frac_copy": ""}
            out.append(row)
            print(f"finish   T={tokens:<5} block {block:<3} warps {warps}  {row['time_us']:8.1f} us", flush=True)
    print("wrote", write_csv(args.out / f"mhc_mixes_tiles_{card.split('_')[-1].lower()}.csv", FIELDS, out))


if __name__ == "__main__":
    main()

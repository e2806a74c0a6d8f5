"""How fast can this GPU read key rows through index lists? The ceiling sparse MLA decode runs into.

The decode kernels read 528-byte fp8 and 288-byte fp4 cache rows (bf16 prefill 1024-byte rows) at
random positions picked by index lists; ``bench_ops.py`` rates them against the device-to-device
copy bandwidth, which streams. This probe reads the same rows through the same lists
(``bench_points``' decode inputs) with a plain Triton kernel that does nothing else: each program
loads 16-byte units of many rows at once (``BLOCK`` units, all in flight together) and reduces
them to one word, so only the reads cost. The same units read in index order (contiguous rows)
calibrate the kernel against the copy.

    python experiments/gather_ceiling.py [study.batch=256] [study.context=65536] [study.output_dir=DIR]
        [overrides...]

Prints a table (GB/s read, and as a fraction of the copy bandwidth measured in the same run) and
writes ``gather_ceiling_<card>.csv`` under ``experiments/results/`` or ``study.output_dir``."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings, timed  # noqa: E402
from bench_points import (FP4_ROW, FP8_ROW, TOPK, WINDOW, _fp4_rows, _fp8_rows, _gen, _per_row_indices,  # noqa: E402
                          extra_region)

BLOCK = 2048


@dataclass
class Settings(StudySettings):
    """The decode point whose index lists are read."""

    FAST = ("study.batch=8", "study.context=8192")
    DEVICE = "cuda"

    batch: int = 256
    """Decode queries (one index list each)."""
    context: int = 65536
    """Context length of each query (the spread of its fp4 top-k indices)."""


@triton.jit
def _read_rows(cache, keys, sums, units_per_row: tl.constexpr, total_units, BLOCK: tl.constexpr):
    unit = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = unit < total_units
    key = tl.load(keys + unit // units_per_row, mask=inside, other=0).to(tl.int64)
    word = (key * units_per_row + unit % units_per_row) * 4
    values = tl.load(cache + word[:, None] + tl.arange(0, 4)[None, :], mask=inside[:, None], other=0)
    tl.store(sums + tl.program_id(0), tl.sum(tl.sum(values, 1), 0))


def read_rows(cache: torch.Tensor, keys: torch.Tensor):
    """``(call, sums)``: the call reads ``cache[keys]`` (uint8 rows, a multiple of 16 bytes) and
    leaves in ``sums`` each program's wrapping int32 sum of its ``BLOCK`` 16-byte units."""
    units_per_row = cache.shape[1] // 16
    words = cache.view(torch.int32).reshape(-1)
    flat = keys.reshape(-1).contiguous()
    total = flat.numel() * units_per_row
    sums = torch.empty(triton.cdiv(total, BLOCK), dtype=torch.int32, device=cache.device)
    grid = (sums.numel(),)
    return (lambda: _read_rows[grid](words, flat, sums, units_per_row, total, BLOCK=BLOCK)), sums


def cases(batch: int, context: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (cache, keys): the decode point's two lists as ``bench_points.mla_decode`` builds them,
    a bf16-row list like prefill's, and each read in order."""
    g = _gen()
    region = extra_region(batch, context)
    fp8, fp4 = _fp8_rows(g, batch * 2 * WINDOW), _fp4_rows(g, batch * region)
    bf16_rows = max(1 << 16, batch * (WINDOW + TOPK))
    bf16 = torch.randint(0, 256, (bf16_rows, 1024), dtype=torch.uint8, device="cuda", generator=g)
    main = _per_row_indices(g, batch, WINDOW, 2 * WINDOW)
    extra = _per_row_indices(g, batch, TOPK, region)
    rows = torch.randint(0, 1 << 16, (batch * (WINDOW + TOPK),), dtype=torch.int32, device="cuda", generator=g)
    ordered = {name: torch.arange(keys.numel(), dtype=torch.int32, device="cuda")
               for name, keys in (("main", main), ("extra", extra), ("bf16", rows))}
    return {
        f"fp8 {FP8_ROW} B rows, {WINDOW} per query": (fp8, main),
        f"fp4 {FP4_ROW} B rows, {TOPK} per query": (fp4, extra),
        "bf16 1024 B rows, random": (bf16, rows),
        f"fp8 {FP8_ROW} B rows in order": (fp8, ordered["main"]),
        f"fp4 {FP4_ROW} B rows in order": (fp4, ordered["extra"]),
        "bf16 1024 B rows in order": (bf16, ordered["bf16"]),
    }


def main(argv=None) -> int:
    _, settings = compose_study("gather_ceiling", Settings, argv)
    card = torch.cuda.get_device_name()
    ceiling = ceilings()
    print(f"{card}: copy {ceiling['copy_bw'] / 1e9:.0f} GB/s (read + write); batch {settings.batch}, "
          f"context {settings.context}")
    rows = []
    for name, (cache, keys) in cases(settings.batch, settings.context).items():
        seconds, _ = timed(read_rows(cache, keys)[0])
        read = keys.numel() * cache.shape[1]
        rows.append(dict(case=name, rows=keys.numel(), row_bytes=cache.shape[1], time_us=seconds * 1e6,
                         gb_s=read / seconds / 1e9, frac_copy=read / seconds / ceiling["copy_bw"]))
        print(f"{name:34s} {keys.numel():8d} rows {seconds * 1e6:8.1f} us {rows[-1]['gb_s']:7.0f} GB/s "
              f"copy {rows[-1]['frac_copy']:.2f}")
    path = write_results(settings.results_path(f"gather_ceiling_{card.split()[-1].lower()}"), rows,
                         study_command("gather_ceiling", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

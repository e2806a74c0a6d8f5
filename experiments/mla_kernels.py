"""The sparse MLA kernels side by side on one GPU: the portable one (``kernels/mla_sparse_decode.py``)
and the warp-specialised one (``kernels/mla_sparse_ws.py``) with its variants, on the decode and
prefill points of ``bench_ops.py``, each through the sm100 wrapper (heads padded, split-KV chosen).

Per point and kernel: the largest difference from the first kernel's output (the portable one,
which the parity grid checks against the reference) relative to that output's largest magnitude,
the time (CUDA-graph replay, median of 5 rounds), TFLOP/s, and the fraction of the dense bf16 rate
and of the copy bandwidth measured in the same run.

    python experiments/mla_kernels.py [study.only=[LABEL_PART,...]] [study.kernels=[NAME,...]]
        [+study.modules.NAME={module:MODULE,OPTION:INT,...}] [study.output_dir=DIR] [overrides...]

Prints a table and writes ``mla_kernels_<card>.csv`` under ``experiments/results/`` or ``study.output_dir``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings, timed  # noqa: E402
from bench_points import Point, mla_decode, mla_prefill  # noqa: E402

POINTS = {  # label -> Point (bench_points); contexts do not change the work, only the index spread
    "decode h=64 B=1": mla_decode(64, 1, 65536),
    "decode h=64 B=16": mla_decode(64, 16, 65536),
    "decode h=64 B=64": mla_decode(64, 64, 65536),
    "decode h=64 B=256": mla_decode(64, 256, 65536),
    "decode h=128 B=64": mla_decode(128, 64, 65536),
    "decode h=128 B=256": mla_decode(128, 256, 65536),
    "prefill h=64 T=1024": mla_prefill(64, 1024),
    "prefill h=128 T=4096": mla_prefill(128, 4096),
}
KERNELS = {  # name -> (kernels module, factory, options), as attention.mla_kernel returns them
    "portable": ("mla_sparse_decode", "sparse_mla", {}),
    "ws": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32}),
    "ws r240/168/96": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "registers": (240, 168, 96)}),
    "ws r232/160/112": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "registers": (232, 160, 112)}),
    "ws r224/160/120": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "registers": (224, 160, 120)}),
    "ws r240/160/104": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "registers": (240, 160, 104)}),
    "ws h8": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "held_calls": 8}),
    "ws r208/168/128": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "registers": (208, 168, 128)}),
    "ws k2r4": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 32, "key_stages": 2, "raw_stages": 4}),
    "ws b64k2": ("mla_sparse_ws", "sparse_mla_ws", {"block_k": 64, "key_stages": 2}),
}


@dataclass
class Settings(StudySettings):
    """Which points and kernels run."""

    FAST = ("study.only=['decode h=64 B=16']", "study.kernels=[portable,ws]")
    DEVICE = "cuda"

    only: list[str] = field(default_factory=list)
    """Keep the points whose label contains one of these (empty: every point)."""
    kernels: list[str] = field(default_factory=list)
    """Kernels to run, by name in ``KERNELS`` (empty: every one)."""
    modules: dict[str, Any] = field(default_factory=dict)
    """Also run ``kernels.MODULE.sparse_mla_ws`` as NAME (e.g. an earlier copy put beside it):
    NAME -> ``{module: MODULE, OPTION: INT, ...}`` (``+study.modules.NAME={...}``), options over ``block_k=32``."""


def bf16_decode(heads: int, batch: int, keys: int):
    """A decode call on a bf16 main cache alone (``keys`` per row, each row its own region)."""
    def build(ops):
        g = torch.Generator("cuda").manual_seed(0)
        cache = torch.randn(batch * 2 * keys, 512, device="cuda", generator=g).bfloat16().view(torch.uint8)
        local = torch.randint(0, 2 * keys, (batch, 1, keys), device="cuda", generator=g)
        args = dict(q=torch.randn(batch, 1, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g),
                    cache=cache, indices=(local + torch.arange(batch, device="cuda")[:, None, None] * 2 * keys).int(),
                    sink=torch.randn(heads, device="cuda", generator=g), scale=512 ** -0.5, cache_format="bf16")
        return lambda: ops.mla_sparse_decode(**args)

    moved = batch * (keys * 1024 + keys * 4 + 2 * heads * 512 * 2 + heads * 4)
    return Point("mla_sparse_decode", f"h={heads} B={batch} keys={keys} bf16", moved, 4.0 * batch * heads * keys * 512,
                 build)


POINTS["decode h=64 B=64 bf16"] = bf16_decode(64, 64, 640)  # no decode step: the kernels without decoding
for _rows, _keys in ((8192, 640), (1 << 16, 2048), (8192, 2048)):  # key rows the L2 holds; time against key count
    POINTS[f"prefill h=64 T=1024 kv={_rows} keys={_keys}"] = mla_prefill(64, 1024, kv_rows=_rows, keys=_keys)
for _topk in (128, 512, 1024, 2048):  # one wave, one CTA a row: time against key count = fixed + per-block cost
    POINTS[f"decode h=64 B=132 topk={_topk}"] = mla_decode(64, 132, 65536, topk=_topk)


def run_with(kernel: tuple, fn):
    """``fn()`` with the sm100 wrapper serving sparse MLA by ``kernel``."""
    from deepinfer_backends.sm100 import attention

    chosen = attention.mla_kernel
    attention.mla_kernel = lambda op, arch=None, batch_invariant=False, options=None: kernel
    try:
        return fn()
    finally:
        attention.mla_kernel = chosen


def op_table(app):
    """The op table of ``app``'s backend (``configs/experiment/<study>.yaml`` picks sm100)."""
    from deepinfer.hal import OpTable

    return OpTable(app.backend.name, app.backend.fallback, dict(app.backend.overrides), options=app.backend.op_options)


def chosen_kernels(settings: Settings) -> dict[str, tuple]:
    """name -> (module, factory, options) in run order: ``settings.kernels`` (names of
    :data:`KERNELS` or ``settings.modules``; all of :data:`KERNELS` when empty), then the
    ``settings.modules`` not named there."""
    table = dict(KERNELS)
    for name, spec in settings.modules.items():
        options = dict(spec)
        table[name] = (options.pop("module"), "sparse_mla_ws", {"block_k": 32} | options)
    names = list(settings.kernels or KERNELS)
    names += [name for name in settings.modules if name not in names]
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"study.kernels names {unknown}, which are neither in KERNELS ({list(KERNELS)}) nor "
                         f"study.modules; add them with +study.modules.NAME={{module:MODULE}}")
    return {name: table[name] for name in names}


def measure_point(label: str, point: Point, ops, kernels: dict[str, tuple], peaks: dict[str, float]) -> list[dict]:
    """One row per kernel that runs at ``point`` (a kernel that fails is printed and left out)."""
    call = point.build(ops)
    first, rows = None, []
    for name, kernel in kernels.items():
        try:
            out = run_with(kernel, call)[0].float()
            seconds, _ = run_with(kernel, lambda: timed(call, reps=point.reps))
        except Exception as error:  # a variant that does not fit is reported, not fatal
            print(f"{label:22s} {name:14s} error: {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        first = out if first is None else first
        row = {"shape": f"{label} ({point.shape})", "kernel": name,
               "max_diff": ((out - first).abs().max() / first.abs().max()).item(), "time_us": seconds * 1e6,
               "tflop_s": point.flops / seconds / 1e12, "frac_dense": point.flops / seconds / peaks["dense_bf16"],
               "gb_s": point.bytes / seconds / 1e9, "frac_copy": point.bytes / seconds / peaks["copy_bw"]}
        rows.append(row)
        print(f"{label:22s} {name:14s} diff {row['max_diff']:.1e} {row['time_us']:9.1f} us "
              f"{row['tflop_s']:6.1f} TF/s dense {row['frac_dense']:.2f}  {row['gb_s']:6.0f} GB/s "
              f"copy {row['frac_copy']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    app, settings = compose_study("mla_kernels", Settings, argv)
    kernels = chosen_kernels(settings)
    ops = op_table(app)
    card = torch.cuda.get_device_name().replace(" ", "_")
    peaks = ceilings()
    print(f"{card}: copy {peaks['copy_bw'] / 1e9:.0f} GB/s, dense bf16 {peaks['dense_bf16'] / 1e12:.0f} TFLOP/s")
    rows = [row for label, point in POINTS.items()
            if not settings.only or any(part in label for part in settings.only)
            for row in measure_point(label, point, ops, kernels, peaks)]
    path = write_results(settings.results_path(f"mla_kernels_{card.split('_')[-1].lower()}"), rows,
                         study_command("mla_kernels", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

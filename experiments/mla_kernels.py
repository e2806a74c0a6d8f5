"""The sparse MLA kernels side by side on one GPU: the portable one (``kernels/mla_sparse_decode.py``)
and the warp-specialised one (``kernels/mla_sparse_ws.py``) with its variants, on the decode and
prefill points of ``bench_ops.py``, each through the sm100 wrapper (heads padded, split-KV chosen).

Per point and kernel: the largest difference from the first kernel's output (the portable one,
which the parity grid checks against the reference) relative to that output's largest magnitude,
the time (CUDA-graph replay, median of 5 rounds), TFLOP/s, and the fraction of the dense bf16 rate
and of the copy bandwidth measured in the same run.

    python experiments/mla_kernels.py [--only LABEL_PART ...] [--kernels NAME ...]
                                      [--module NAME=MODULE[,OPTION=INT...] ...] [--out DIR]

Prints a table and writes ``mla_kernels_<card>.csv`` under ``experiments/results/`` or ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import RESULTS, _op_table, ceilings, timed, write_csv  # noqa: E402
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
FIELDS = ("card", "date", "command", "shape", "kernel", "max_diff", "time_us", "tflop_s", "frac_dense", "gb_s",
          "frac_copy")


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
    attention.mla_kernel = lambda op, arch=None, batch_invariant=False: kernel
    try:
        return fn()
    finally:
        attention.mla_kernel = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="keep points whose label contains one of these")
    parser.add_argument("--kernels", nargs="*", default=None, help=f"kernels to run (default all: {list(KERNELS)})")
    parser.add_argument("--module", nargs="*", default=[], metavar="NAME=MODULE",
                        help="also run kernels.MODULE.sparse_mla_ws as NAME (e.g. an earlier copy put beside it); "
                             "NAME=MODULE,block_k=64,key_stages=2 sets its integer options")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for spec in args.module:
        name, module, *options = spec.replace(",", "=").split("=")
        options = {key: int(value) for key, value in zip(options[::2], options[1::2])}
        KERNELS[name] = (module, "sparse_mla_ws", {"block_k": 32} | options)
    ops = _op_table([], "sm100")
    card = torch.cuda.get_device_name().replace(" ", "_")
    peaks = ceilings()
    print(f"{card}: copy {peaks['copy_bw'] / 1e9:.0f} GB/s, dense bf16 {peaks['dense_bf16'] / 1e12:.0f} TFLOP/s")
    stamp, command = datetime.datetime.now().isoformat(timespec="minutes"), " ".join(sys.argv)
    names = args.kernels or list(KERNELS)
    names += [spec.split("=")[0] for spec in args.module if spec.split("=")[0] not in names]
    rows_out = []
    for label, point in POINTS.items():
        if args.only and not any(part in label for part in args.only):
            continue
        call = point.build(ops)
        first = None
        for name in names:
            kernel = KERNELS[name]
            try:
                out = run_with(kernel, call)[0].float()
                seconds, _ = run_with(kernel, lambda: timed(call, reps=point.reps))
            except Exception as error:  # a variant that does not fit is reported, not fatal
                print(f"{label:22s} {name:14s} error: {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            first = out if first is None else first
            row = {"card": card, "date": stamp, "command": command, "shape": f"{label} ({point.shape})",
                   "kernel": name, "max_diff": ((out - first).abs().max() / first.abs().max()).item(),
                   "time_us": seconds * 1e6,
                   "tflop_s": point.flops / seconds / 1e12, "frac_dense": point.flops / seconds / peaks["dense_bf16"],
                   "gb_s": point.bytes / seconds / 1e9, "frac_copy": point.bytes / seconds / peaks["copy_bw"]}
            rows_out.append(row)
            print(f"{label:22s} {name:14s} diff {row['max_diff']:.1e} {row['time_us']:9.1f} us "
                  f"{row['tflop_s']:6.1f} TF/s dense {row['frac_dense']:.2f}  {row['gb_s']:6.0f} GB/s "
                  f"copy {row['frac_copy']:.2f}", flush=True)
    path = write_csv(args.out / f"mla_kernels_{card.split('_')[-1].lower()}.csv", FIELDS, rows_out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where a CTA of the warp-specialised sparse MLA kernel spends its time: a traced copy of
``kernels/mla_sparse_ws.py`` records ``clock()`` at the phase boundaries of each role (and the
global timer at the CTA's start and end) and writes them over its row's ``lse``; this script runs
it on decode points and prints each phase's median, min and max over the CTAs, and writes them to
``mla_trace_<card>.csv`` under ``experiments/results/`` or ``study.output_dir``.

    python experiments/mla_trace.py [study.only=[LABEL_PART,...]] [study.output_dir=DIR] [overrides...]

The copy is made by inserting stamp statements after anchor lines of the kernel's source (each
anchor must occur once, so a changed kernel fails loudly here rather than tracing the wrong place).
Its outputs other than ``lse`` are the kernel's; the stamps add a little to its time
(``experiments/results/mla_kernels_h200.txt``). Diagnostics only: nothing else imports it."""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import timed  # noqa: E402
from bench_points import mla_decode  # noqa: E402
from mla_kernels import op_table, run_with  # noqa: E402

TRACE_MODULE = "mla_sparse_ws_trace"
SLOTS = 16
PRELUDE = r"""
__device__ __forceinline__ unsigned mla_clock() { return (unsigned)clock(); }
__device__ __forceinline__ unsigned mla_gtime() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return (unsigned)t; }
__device__ __forceinline__ void mla_dump(float* dst, const unsigned* src) {
  for (int i = 0; i < 16; ++i) reinterpret_cast<unsigned*>(dst)[i] = src[i]; }
"""
# (anchor line, stamp slot, thread that records, condition on the block index t or None)
STAMPS = [
    ("T.sync_threads()  # the key list is whole", 1, 0, None),
    ("T.fill(m, NEG)", 2, 0, None),
    ("T.barrier_wait(k_ready[j], (t // k_stages) & 1)", 3, 0, "t == 0"),
    ("T.barrier_wait(k_ready[j], (t // k_stages) & 1)", 4, 0, "t == blocks - 1"),
    ("shared.row_stats(m, l, sink, hb, lse_row, gate)", 5, 0, None),
    ("store_half(acc_o, q_s, out, row, hb, split, 0, CONSUMER0_BAR)", 6, 0, None),
    ("T.barrier_wait(p_ready, t & 1)", 7, 128, "t == 0"),
    ("store_half(acc_o, q_s, out, row, hb, split, half, CONSUMER1_BAR)", 8, 128, None),
    ("T.sync_threads(PRODUCER_BAR, 128)  # everyone's have; slot t-1 is decoded", 9, 256, "t == 0"),
    ("T.barrier_arrive(k_ready[stage])", 10, 256, "t == 0"),
    ("T.barrier_arrive(k_ready[stage])", 11, 256, "t == blocks - 1"),
]
PHASES = [  # label, from slot, to slot (0: CTA start, 12: CTA end)
    ("key lists read", 0, 1), ("q landed (consumer 0 ready)", 0, 2), ("first raw block landed", 0, 9),
    ("first block decoded", 0, 10), ("consumer 0 has block 0", 0, 3), ("consumer 1 has P 0", 0, 7),
    ("block 0 -> last block (consumer 0)", 3, 4), ("last block and row stats (consumer 0)", 4, 5),
    ("output store (consumer 0)", 5, 6), ("output store (consumer 1, from consumer 0's row stats)", 5, 8),
    ("producer's last block decoded", 0, 11), ("CTA end", 0, 12),
]


@dataclass
class Settings(StudySettings):
    """The decode points traced."""

    FAST = ("study.only=['B=132']",)
    DEVICE = "cuda"

    only: list[str] = field(default_factory=list)
    """Keep the points whose label contains one of these (empty: both)."""


def traced_source(source: str) -> str:
    """``mla_sparse_ws``'s source with the stamps of :data:`STAMPS` inserted."""
    def insert_after(anchor: str, code: list[str]):
        nonlocal source
        lines = source.split("\n")
        hits = [i for i, line in enumerate(lines) if line.strip().startswith(anchor)]
        if len(hits) != 1:
            raise RuntimeError(f"anchor {anchor!r} found {len(hits)} times in mla_sparse_ws.py")
        indent = " " * (len(lines[hits[0]]) - len(lines[hits[0]].lstrip()))
        lines[hits[0] + 1:hits[0] + 1] = [indent + line for line in code]
        source = "\n".join(lines)

    clock = 'T.call_extern("uint32", "mla_clock")'
    for anchor, slot, thread, when in STAMPS:
        code = [f"if tx == {thread}:"] + ([f"    if {when}:", f"        stamps[{slot}] = {clock}"] if when
                                          else [f"    stamps[{slot}] = {clock}"])
        insert_after(anchor, code)
    insert_after("tx = T.get_thread_binding()", [
        f'stamps = T.alloc_shared(({SLOTS},), "uint32")', "if tx == 0:", f"    stamps[0] = {clock}",
        '    stamps[13] = T.call_extern("uint32", "mla_gtime")'])
    lines = source.split("\n")  # after the role branches: every thread meets, thread 0 writes the stamps
    last = max(i for i, line in enumerate(lines) if "T.cp_async_barrier_noinc(k_ready[stage])" in line)
    lines[last + 1:last + 1] = [" " * 12 + line for line in [
        "T.sync_threads()", "if tx == 0:", f"    stamps[12] = {clock}",
        '    stamps[14] = T.call_extern("uint32", "mla_gtime")',
        '    T.call_extern("handle", "mla_dump", T.access_ptr(lse[row, hb * BLOCK_H], "w"), '
        'T.access_ptr(stamps[0], "r"))']]
    source = "\n".join(lines).replace("prelude=key_decode.PRELUDE + ROWS_MOVED",
                                      "prelude=key_decode.PRELUDE + ROWS_MOVED + TRACE_PRELUDE")
    return source.replace("\nBLOCK_H = 64\n", f"\nBLOCK_H = 64\nTRACE_PRELUDE = r'''{PRELUDE}'''\n")


def load_traced() -> None:
    """Import the traced copy as ``deepinfer_backends.sm100.kernels.mla_sparse_ws_trace``."""
    from deepinfer_backends.sm100.kernels import mla_sparse_ws

    path = Path(tempfile.mkdtemp()) / f"{TRACE_MODULE}.py"
    path.write_text(traced_source(Path(mla_sparse_ws.__file__).read_text()))
    name = f"deepinfer_backends.sm100.kernels.{TRACE_MODULE}"
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def report(label: str, lse: torch.Tensor, seconds: float) -> list[dict]:
    """Print each of :data:`PHASES` over the CTAs from the stamps the traced kernel left in ``lse``;
    one row per phase (median, min and max microseconds)."""
    stamps = lse.reshape(lse.shape[0], -1)[:, :SLOTS].contiguous().view(torch.int32).long().cpu() & 0xFFFFFFFF
    span = lambda a, b: ((stamps[:, b] - stamps[:, a]) & 0xFFFFFFFF).double()  # noqa: E731 (cycles, or ns: 13, 14)
    ghz = (span(0, 12) / span(13, 14)).median().item()
    start = ((stamps[:, 13] - stamps[:, 13].min()) & 0xFFFFFFFF).double() / 1e3
    print(f"== {label}: {seconds * 1e6:.1f} us a call; CTAs start over {start.max():.1f} us; SM clock {ghz:.2f} GHz")
    rows = []
    for name, a, b in PHASES:
        us = span(a, b) / ghz / 1e3
        print(f"   {name:52s} median {us.median():7.2f} us  min {us.min():7.2f}  max {us.max():7.2f}")
        rows.append({"point": label, "call_us": seconds * 1e6, "sm_ghz": ghz, "phase": name,
                     "median_us": us.median().item(), "min_us": us.min().item(), "max_us": us.max().item()})
    return rows


def main(argv=None) -> int:
    app, settings = compose_study("mla_trace", Settings, argv)
    load_traced()
    ops, kernel = op_table(app), (TRACE_MODULE, "sparse_mla_ws", {"block_k": 32})
    rows = []
    for label, point in (("decode h=64 B=132 (one wave)", mla_decode(64, 132, 65536)),
                         ("decode h=64 B=256 (two waves)", mla_decode(64, 256, 65536))):
        if settings.only and not any(part in label for part in settings.only):
            continue
        call = point.build(ops)
        seconds, _ = run_with(kernel, lambda: timed(call, reps=point.reps))
        _, lse = run_with(kernel, call)
        torch.cuda.synchronize()
        rows += report(label, lse, seconds)
    card = torch.cuda.get_device_name().replace(" ", "_")
    path = write_results(settings.results_path(f"mla_trace_{card.split('_')[-1].lower()}"), rows,
                         study_command("mla_trace", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU time per HAL op: which ops (and which kernels outside every op) a traced stretch of
engine steps spends its kernel time in.

    with labelled_ops(llm.ops), torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        ...engine steps...
    print(op_table(op_times(prof)))

Each op call runs inside a profiler range ``hal::<op>``, which the profiler also draws on the GPU
timeline (from the op's first kernel to its last); a kernel counts for the op whose span it
starts in, or as ``outside ops: <kernel name>``."""
from __future__ import annotations

import bisect
import contextlib
import functools

import torch

PREFIX = "hal::"


@contextlib.contextmanager
def labelled_ops(ops):
    """Every op of the :class:`~deepinfer.hal.registry.OpTable` ``ops`` called inside a
    ``hal::<op>`` profiler range for the duration of the block."""
    saved = dict(ops._impls)
    for name, impl in saved.items():
        ops._impls[name] = _labelled(name, impl)
    try:
        yield ops
    finally:
        ops._impls.update(saved)


def _labelled(name: str, impl):
    @functools.wraps(impl)
    def call(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + name):
            return impl(*args, **kwargs)
    return call


def op_times(prof) -> dict[str, list]:
    """``{label: [kernel microseconds, kernels]}`` of a profile with CUDA activity taken under
    :func:`labelled_ops`: each kernel counts for the op whose range (the profiler's GPU-side
    span of ``hal::<op>``) it starts in, or as ``outside ops: <kernel>``."""
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in device if is_op_range(e))
    starts = [start for start, _, _ in spans]
    totals: dict[str, list] = {}
    for event in device:
        if is_op_range(event):
            continue
        begin = event.time_range.start
        i = bisect.bisect_right(starts, begin) - 1
        label = spans[i][2] if i >= 0 and begin < spans[i][1] else "outside ops: " + event.name[:80]
        entry = totals.setdefault(label, [0.0, 0])
        entry[0] += event.time_range.end - begin
        entry[1] += 1
    return totals


def is_op_range(event) -> bool:
    """``event`` is the GPU-side span of an op's range, not a kernel."""
    return event.name.startswith(PREFIX)


def op_table(totals: dict[str, list], top: int = 30) -> str:
    """The ``top`` labels by GPU time: milliseconds, share of all kernel time, kernel count."""
    whole = sum(us for us, _ in totals.values()) or 1.0
    lines = [f"  {'GPU ms':>8} {'share':>6} {'kernels':>7}  op (or the kernel outside every op)"]
    for label, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} {100 * us / whole:5.1f}% {count:7d}  {label[:100]}")
    return "\n".join(lines)

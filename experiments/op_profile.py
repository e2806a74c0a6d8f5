"""GPU time per HAL op: which ops (and which kernels outside every op) a traced stretch of
engine steps spends its kernel time in.

    with labelled_ops(llm.ops), torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        ...engine steps...
    print(op_table(op_times(prof)))

Each op call runs inside a profiler range ``hal::<op>``, which the profiler also draws on the GPU
timeline (from the op's first kernel to its last); a kernel counts for the op whose span it
starts in, or as ``outside ops: <kernel name>``. :func:`prefill_kernels` and
:func:`decode_kernels` trace an engine's prefill and eager decode steps that way, and
:func:`gpu_busy` measures the GPU's idle share of a trace."""
from __future__ import annotations

import bisect
import contextlib
import functools
import math
import time

import torch

from deepinfer import SamplingParams

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


def idle_gaps(prof, shortest_us: float = 20.0, top: int = 8) -> str:
    """Where the GPU waits in a profile taken under :func:`labelled_ops`: the time from the first
    host event to the first kernel (the host preparing the step), the gaps between kernels of at
    least ``shortest_us`` (their count and sum), and the ``top`` longest, each with the op or
    kernel that ran before it and the one it waited for."""
    device = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    host = [e.time_range.start for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    if not device or not host:
        return "idle gaps: no events"
    labels, end, gaps = {}, -float("inf"), []
    ranges = [e for e in device if is_op_range(e)]
    for e in ranges:
        for k in device:
            if not is_op_range(k) and e.time_range.start <= k.time_range.start < e.time_range.end:
                labels.setdefault(id(k), e.name[len(PREFIX):])
    kernels = [e for e in device if not is_op_range(e)]
    before = None
    for k in kernels:
        if before is not None and k.time_range.start - end >= shortest_us:
            gaps.append((k.time_range.start - end, before, labels.get(id(k), k.name[:40])))
        if k.time_range.end >= end:
            end, before = k.time_range.end, labels.get(id(k), k.name[:40])
    lead = kernels[0].time_range.start - min(host)
    lines = [f"idle gaps: {lead / 1e3:.2f} ms from the first host event to the first kernel; "
             f"{len(gaps)} gaps of at least {shortest_us:.0f} us between kernels, {sum(g for g, _, _ in gaps) / 1e3:.2f} ms"]
    for gap, after, waiting in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {gap / 1e3:7.3f} ms after {after[:40]:<40} before {waiting[:40]}")
    return "\n".join(lines)


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
         "aten::nonzero", "cudaMemcpy")
"""Host events that wait for the GPU (``cudaMemcpy``: the synchronous copy, not ``cudaMemcpyAsync``)."""


def host_syncs(prof) -> str:
    """The host events of a profile taken under :func:`labelled_ops` that wait for the GPU
    (:data:`SYNCS`), counted by the op whose host-side range holds them (or ``outside ops``)."""
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in host if is_op_range(e))
    starts = [start for start, _, _ in ranges]
    counts: dict[str, int] = {}
    for e in host:
        if e.name not in SYNCS:
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        label = ranges[i][2] if i >= 0 and e.time_range.start < ranges[i][1] else "outside ops"
        key = f"{e.name} in {label}"
        counts[key] = counts.get(key, 0) + 1
    listed = ", ".join(f"{key} x{n}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"host syncs: {sum(counts.values())}" + (f" ({listed})" if listed else "")


def prefill_kernels(llm, prompts: list[list[int]], top: int = 25) -> str:
    """The prefill of fresh requests of ``prompts`` (token ids) on ``llm`` under the profiler:
    GPU-busy share, kernel count, where the GPU waits (:func:`idle_gaps`) and the host waits for
    it (:func:`host_syncs`), the GPU time of each HAL op and the ``top`` kernels by total GPU
    time."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in prompts]
    batch, prompt = len(prompts), len(prompts[0])
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with labelled_ops(llm.ops), torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        while not all(r.finished for r in requests):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    busy = gpu_busy(prof, steps=1)
    totals: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not is_op_range(e):
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.end - e.time_range.start
            entry[1] += 1
    gpu_us = sum(t for t, _ in totals.values())
    lines = [f"prefill trace, {batch} x {prompt} tokens: wall {1e3 * wall:.1f} ms (traced, ops labelled), kernels "
             f"{busy['gpu_kernels_per_step']:.0f}, GPU idle {busy['gpu_idle_pct']} %, "
             f"kernel time {gpu_us / 1e3:.1f} ms", idle_gaps(prof), host_syncs(prof), "by op:",
             op_table(op_times(prof)), "by kernel:"]
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms {100 * us / gpu_us:5.1f} % x{count:<5d} {name[:110]}")
    return "\n".join(lines)


def decode_kernels(llm, prompts: list[list[int]], steps: int = 4) -> str:
    """``steps`` decode steps of fresh requests of ``prompts`` (token ids) on ``llm`` run eagerly
    (the captured graphs set aside, so every HAL op call is labelled) under the profiler: kernels
    per step, and per op its GPU time and kernel count over the steps. A graph replays the same
    kernels."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in prompts]
    while llm.step().num_prefill_tokens:
        pass
    llm.step()
    passes, llm.runner.passes = llm.runner.passes, {}
    try:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with labelled_ops(llm.ops), torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                llm.step()
            torch.cuda.synchronize()
    finally:
        llm.runner.passes = passes
    while not all(r.finished for r in requests):
        llm.step()
    busy = gpu_busy(prof, steps=steps)
    return "\n".join([f"decode trace, batch {len(prompts)}, {steps} eager steps: kernels "
                      f"{busy['gpu_kernels_per_step']:.0f} a step", "by op (all steps):",
                      op_table(op_times(prof), top=60)])


def gpu_busy(prof, steps: int = 8) -> dict:
    """GPU-busy share of the traced steps: the union of kernel (and copy) intervals over the span
    from the first to the last one (``gpu_idle_pct``: all idle time, also the gaps between the
    kernels of one step), the idle time between consecutive steps (``gpu_idle_between_steps_pct``:
    from the end of a step's copy to the host to the start of the next device work), and kernels
    per step."""
    spans = sorted((e.time_range.start, e.time_range.end, "DtoH" in e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not is_op_range(e))
    busy, between, end, after_copy = 0.0, 0.0, -math.inf, None
    for lo, hi, copy_down in spans:
        if after_copy is not None and lo >= after_copy:
            between += lo - after_copy
            after_copy = None
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
        if copy_down:
            after_copy = hi
    total = spans[-1][1] - spans[0][0]
    return dict(gpu_idle_pct=round(100 * (1 - busy / total), 2),
                gpu_idle_between_steps_pct=round(100 * between / total, 2),
                gpu_kernels_per_step=round(len(spans) / steps, 1))

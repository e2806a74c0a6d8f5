"""How many paged KV blocks the engine allocates.

On a device that reports its memory, a worst-case step (a full token budget of prefill chunks,
every row of a full verify step sampled) runs once on scratch caches. The engine's share is
``gpu_memory_utilization`` of the device: the blocks take that share less the weights and twice
the step's activation peak (once for eager steps, once for the CUDA graphs' pool), and never
more than is free. Elsewhere (the CPU), ``max_num_seqs`` sequences of ``max_model_len`` get
room. ``engine.num_kv_blocks`` overrides both."""
from __future__ import annotations

import math

import torch

from deepinfer.engine.device import Runtime
from deepinfer.hal.registry import OpTable
from deepinfer.hal.value_checks import skip_value_checks
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.interface import GenerativeModel

GIB = 1 << 30
RESERVE = GIB
"""Device memory left free beside the engine's own (library workspaces, the CUDA context)."""


def plan_kv_blocks(model: GenerativeModel, ops: OpTable, runtime: Runtime, engine, num_draft_tokens: int,
                   graphs: bool, weight_bytes: int) -> int:
    """Blocks to allocate (block 0, the padding block, included) for the ``engine`` config;
    ``weight_bytes``: device memory the model's weights took."""
    page, max_len = model.page_tokens, model.max_model_len
    per_seq = math.ceil(max_len / page)
    slots = engine.max_num_seqs + 1
    if engine.num_kv_blocks:
        blocks = engine.num_kv_blocks
        if blocks - 1 < per_seq:
            raise ValueError(f"engine.num_kv_blocks={blocks} cannot hold one sequence of max_model_len {max_len} "
                             f"({per_seq} blocks of {page} plus the padding block)")
        return blocks
    memory = runtime.memory()
    if memory is None:
        return 1 + engine.max_num_seqs * per_seq
    free, total = memory
    activation = _profile_step(model, ops, runtime, engine, num_draft_tokens) * (2 if graphs else 1)
    per_block = model.cache_bytes(1, 0)
    share = total * engine.gpu_memory_utilization - weight_bytes - activation
    room = min(share, free - activation - RESERVE) - model.cache_bytes(0, slots)
    blocks = int(room // per_block)
    if blocks - 1 < per_seq:
        raise ValueError(
            f"engine.gpu_memory_utilization={engine.gpu_memory_utilization} leaves {max(room, 0) / GIB:.2f} GiB for "
            f"the KV cache ({total / GIB:.1f} GiB on the device, {free / GIB:.2f} GiB free, weights "
            f"{weight_bytes / GIB:.2f} GiB, activations {activation / GIB:.2f} GiB{' with CUDA graphs' if graphs else ''}"
            f"); one sequence of max_model_len {max_len} needs {(per_seq + 1) * per_block / GIB:.2f} GiB: raise "
            f"engine.gpu_memory_utilization, free the device, or lower model.max_model_len or "
            f"engine.max_num_batched_tokens")
    return blocks


def _profile_step(model: GenerativeModel, ops: OpTable, runtime: Runtime, engine, num_draft_tokens: int) -> int:
    """Peak activation bytes of the worst-case step (scratch caches excluded)."""
    page, budget = model.page_tokens, engine.max_num_batched_tokens
    chunk = max(1, min(engine.prefill_chunk_tokens, model.max_model_len - 1))
    lens = [chunk] * (budget // chunk) + ([budget % chunk] if budget % chunk else [])
    sample_rows = min(budget, engine.max_num_seqs * (num_draft_tokens + 1))
    blocks, next_block = [], 1
    for n in lens:
        count = math.ceil(n / page)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    runtime.synchronize()
    before = runtime.allocated()
    runtime.reset_peak()
    caches = model.allocate_caches(next_block, len(lens) + 1)
    scratch = runtime.allocated() - before
    ends = [sum(lens[:i + 1]) for i in range(len(lens))]
    rows = sorted(set(range(budget - sample_rows, budget)) | {e - 1 for e in ends})
    ctx = ForwardContext.for_sequences([[model.draft_noise_token] * n for n in lens], [0] * len(lens),
                                       list(range(1, len(lens) + 1)), blocks, logits_rows=rows,
                                       device=runtime.device, upload=runtime.upload)
    with torch.no_grad(), skip_value_checks():
        logits = model(ctx, caches)
        count = logits.shape[0]
        ones = torch.ones(count, device=logits.device)
        ops.sample(logits, ones, ones * 0.9, torch.zeros(count, dtype=torch.int64, device=logits.device),
                   torch.zeros(count, dtype=torch.int64, device=logits.device),
                   torch.arange(count, device=logits.device))
    runtime.synchronize()
    peak = runtime.peak_allocated() - before - scratch
    del caches, logits, ctx
    return max(peak, 0)

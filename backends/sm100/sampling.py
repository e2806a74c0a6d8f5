"""sm100 ``sample`` and ``speculative_accept``: one Triton program per row, no host syncs
(:mod:`.fused.sampling`, :mod:`.fused.speculative`)."""
from __future__ import annotations

import torch

from deepinfer.hal.ops.sampling import CASE_SAMPLE, SEED_NAMESPACE_TARGET, check_sample_args, namespaced_seeds
from deepinfer.hal.ops.speculative import check_speculative_args
from deepinfer_backends.sm100.launch import on_device, require

MAX_VOCAB = 1 << 30
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def sample(logits, temperature, top_p, top_k, seeds, positions, case=CASE_SAMPLE, namespace=SEED_NAMESPACE_TARGET,
           filters=True, filter_order="deepinfer"):
    """HAL ``sample`` for CUDA tensors (``logits`` float32, bf16, fp16 or float64, a vocabulary of
    1 to :data:`MAX_VOCAB`), in either filter order: ``(token_ids int64 [N], logprobs float32
    [N, V])``, one launch."""
    op = "sample"
    require(all(on_device(t) for t in (logits, temperature, top_p, top_k, seeds, positions)), op,
            "logits, temperature, top_p, top_k, seeds and positions must be CUDA tensors")
    check_sample_args(logits, temperature, top_p, top_k, seeds, positions, case, filter_order)
    namespaced_seeds(seeds[:0], namespace)  # the reference's check of namespace, on no rows
    rows, vocab = logits.shape
    require(1 <= vocab <= MAX_VOCAB, op, f"the vocabulary must hold 1 to {MAX_VOCAB} tokens, got {vocab}")
    require({logits.dtype, temperature.dtype, top_p.dtype} <= set(FLOATS), op,
            f"logits, temperature and top_p must be float32, bf16, fp16 or float64, got {logits.dtype}, "
            f"{temperature.dtype} and {top_p.dtype}")
    token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows:
        from deepinfer_backends.sm100.fused.sampling import BLOCK_VOCAB, NUM_WARPS, sample_kernel

        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        sample_kernel[(rows,)](
            logits, temperature.contiguous(), top_p.contiguous(), top_k.contiguous(), seeds.contiguous(),
            positions.contiguous(), token_ids, logprobs, vocab, logits.stride(0), CASE=case, NAMESPACE=namespace,
            FILTERS=bool(filters), DEEPINFER=filter_order == "deepinfer", BLOCK=BLOCK_VOCAB, num_warps=NUM_WARPS,
            enable_fp_fusion=False)
    return token_ids, logprobs


def speculative_accept(target_logprobs, draft_logprobs, draft_ids, seeds, positions):
    """HAL ``speculative_accept`` for CUDA tensors (log-probabilities float32, bf16, fp16 or
    float64, a vocabulary of 1 to :data:`MAX_VOCAB`): ``(accepted bool [R], resampled int64 [R])``,
    one launch."""
    op = "speculative_accept"
    require(all(on_device(t) for t in (target_logprobs, draft_logprobs, draft_ids, seeds, positions)), op,
            "target_logprobs, draft_logprobs, draft_ids, seeds and positions must be CUDA tensors")
    check_speculative_args(target_logprobs, draft_logprobs, draft_ids, seeds, positions)
    rows, vocab = target_logprobs.shape
    require(1 <= vocab <= MAX_VOCAB, op, f"the vocabulary must hold 1 to {MAX_VOCAB} tokens, got {vocab}")
    require({target_logprobs.dtype, draft_logprobs.dtype} <= set(FLOATS), op,
            f"the log-probabilities must be float32, bf16, fp16 or float64, got {target_logprobs.dtype} and "
            f"{draft_logprobs.dtype}")
    accepted = torch.empty(rows, dtype=torch.bool, device=target_logprobs.device)
    resampled = torch.empty(rows, dtype=torch.int64, device=target_logprobs.device)
    if rows:
        from deepinfer_backends.sm100.fused.speculative import BLOCK_VOCAB, NUM_WARPS, speculative_kernel

        target = target_logprobs if target_logprobs.stride(1) == 1 else target_logprobs.contiguous()
        draft = draft_logprobs if draft_logprobs.stride(1) == 1 else draft_logprobs.contiguous()
        speculative_kernel[(rows,)](
            target, draft, draft_ids.contiguous(), seeds.contiguous(), positions.contiguous(),
            accepted.view(torch.uint8), resampled, vocab, target.stride(0), draft.stride(0), BLOCK=BLOCK_VOCAB,
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    return accepted, resampled

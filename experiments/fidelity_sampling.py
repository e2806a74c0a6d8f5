"""The sampling rows of :mod:`fidelity`: top-k/top-p kept sets, greedy, the seeded draw streams,
the verify rows' counters and speculative acceptance, ours against DeepInfer 0.1.0's references."""
from __future__ import annotations

import torch

from deepinfer.hal.ops import sampling, speculative
from fidelity_compare import row


def _their_sampling(up, logits, temperature, top_p, top_k, seeds=None, positions=None, **kwargs):
    """``fused_sample_ref`` on a copy of ``logits``; ``top_k <= 0`` means off (their -1)."""
    transform = up.engine.LogitsTransformInputs(temperature.float(), top_p.float(),
                                                torch.where(top_k > 0, top_k, -1).int())
    inputs = transform if seeds is None else up.engine.SamplingKernelInputs(transform, seeds.to(torch.uint64),
                                                                             positions.int())
    return up.sample.fused_sample_ref(logits.clone(), inputs, **kwargs)


def _logit_cases(gen, rows, vocab):
    """Flat (2 * randn), peaked (8 tokens near 18) and tied (integers 0-2) logits."""
    flat = 2 * torch.randn(rows, vocab, generator=gen)
    peaked = flat.clone().scatter_(1, torch.randint(0, vocab, (rows, 8), generator=gen),
                                   18 + 2 * torch.randn(rows, 8, generator=gen))
    tied = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    return {"flat": flat, "peaked": peaked, "tied (integer)": tied}


def sampling_rows(up, gen) -> list[dict]:
    """Kept sets of top-k with top-p, greedy, the seeded draw streams and the verify-row counters."""
    rows, count, vocab = [], 128, 129280
    seeds = torch.randint(0, 1 << 62, (count,), generator=gen)
    positions = torch.randint(0, 1 << 20, (count,), generator=gen)
    temperature = 0.5 + torch.rand(count, generator=gen)
    top_p = 0.5 + 0.49 * torch.rand(count, generator=gen)
    top_k = torch.randint(5, 200, (count,), generator=gen)
    off, ones = torch.zeros(count, dtype=torch.int64), torch.ones(count)
    cases = _logit_cases(gen, count, vocab)
    rounding = ("theirs computes a token's preceding mass as the float32 cumsum - p, which can keep one more token "
                "when that rounds to top_p; ours sums it in float64")
    for filters, p, k, names, order, why in (
            ("top-k and top-p both set", top_p, top_k, cases, "deepinfer", "both top-p on the full softmax, then "
             "exactly k by rank (ties to the lower token id); " + rounding),
            ("top-p only", top_p, off, ("flat", "tied (integer)"), "deepinfer", "both keep a token while the mass "
             "ranked before it is at most top_p, ties cut by token id; " + rounding),
            ("top-k only", ones, top_k, ("flat", "tied (integer)"), "deepinfer", "both keep exactly k, a tie at the "
             "k-th value going to the lower token id"),
            ("decoding.filter_order=vllm, top-k and top-p both set", top_p, top_k, ("flat", "tied (integer)"), "vllm",
             "the documented option: ours top-k (ties kept), renormalise, then top-p (ties kept); theirs top-p on "
             "the full softmax, then exactly k")):
        for name in names:
            _, ours = sampling.sample(cases[name], temperature, p, k, seeds, positions, filter_order=order)
            theirs = _their_sampling(up, cases[name], temperature, p, k)[0]
            kept = torch.isfinite(ours) & torch.isfinite(theirs)
            rows.append(row(f"sampling filters, {filters}, {name} logits", "hal.ops.sampling.sample",
                            "fused_sample.fused_sample_ref (apply_top_p_top_k_ref)", torch.isfinite(ours),
                            torch.isfinite(theirs), None, per_row=True, max_abs=(ours - theirs)[kept].abs().max().item(),
                            note=f"share of rows whose kept set differs; max abs diff: logprobs of tokens both "
                                 f"keep; {why}"))
    rows += greedy_rows(up, gen, seeds, positions, vocab)
    rows += stream_rows(up, gen)
    return rows + [verify_counter_row(up, gen), *speculative_rows(up, gen)]


def greedy_rows(up, gen, seeds, positions, vocab) -> list[dict]:
    """Our temperature 0 (first maximal token) against their temperature 1e-5, top-p 1, top-k off."""
    count, rows = seeds.shape[0], []
    flat = 2 * torch.randn(count, vocab, generator=gen)
    tied = flat.clone()
    top = tied.argmax(dim=1)
    twin = (top + 1 + torch.randint(0, vocab - 1, (count,), generator=gen)) % vocab
    tied[torch.arange(count), twin] = tied[torch.arange(count), top]
    off = torch.zeros(count, dtype=torch.int64)
    for name, logits in (("distinct maximum", flat), ("two-way tie at the maximum", tied)):
        ours, _ = sampling.sample(logits, torch.zeros(count), torch.ones(count), off, seeds, positions)
        theirs = _their_sampling(up, logits, torch.full((count,), 1e-5), torch.ones(count), off, seeds,
                                 positions)[1]
        rows.append(row(f"greedy, {name}", "hal.ops.sampling.sample (temperature 0)",
                        "fused_sample.fused_sample_ref (temperature 1e-5, as SamplingParams sets it)",
                        ours, theirs.long(), None, note="share of rows whose token differs; theirs draws among "
                        "tokens within ~1e-4 of the maximum (a tie: either twin), ours takes the first maximum"))
    return rows


def stream_rows(up, gen) -> list[dict]:
    """The same (seed, position, case) through both draws over a distribution of 4096 tokens
    (softmax of 2 * randn, a tenth of the tokens at probability 0, from a generator of its own,
    so the shared generator's stream past this group does not depend on it): equal tokens need an
    equal uniform and the same inversion of the CDF."""
    count, vocab, rows = 4096, 4096, []
    seeds = torch.randint(0, 1 << 62, (count,), generator=gen)
    positions = torch.randint(0, 1 << 20, (count,), generator=gen)
    own = torch.Generator().manual_seed(vocab)
    logits = 2 * torch.randn(count, vocab, generator=own)
    probs = torch.softmax(logits.masked_fill(torch.rand(count, vocab, generator=own) < 0.1, float("-inf")), dim=-1)
    for case, name in ((sampling.CASE_SAMPLE, "sample"), (sampling.CASE_RESAMPLE, "resample")):
        ours = sampling.cdf_draw(probs, seeds, positions, case)
        theirs = up.draw.random_sampling_ref(probs, seeds.to(torch.uint64), positions.int(),
                                             is_nextn_predict=case == sampling.CASE_RESAMPLE)
        rows.append(row(f"seeded draw stream, case {case} ({name})", "hal.ops.sampling.cdf_draw",
                        "random_sampling.random_sampling_ref", ours, theirs.long(), None,
                        note="share of draws that differ; both seed + (m ^ m<<13) with m = (3p+case)*golden "
                             "into SplitMix64, a 53-bit uniform, and the first token whose float64 prefix sum "
                             "exceeds u * total"))
    return rows


def verify_counter_row(up, gen) -> dict:
    """Sample positions of a decode step's rows (requests with 0-5 drafts)."""
    requests = 64
    rows_per_request = torch.randint(1, 7, (requests,), generator=gen)
    base = torch.randint(0, 1 << 20, (requests,), generator=gen)
    first = torch.cumsum(rows_per_request, 0) - rows_per_request
    total = int(rows_per_request.sum())
    to_request, local_step, _ = up.verify.prepare_verification_metadata_ref(first.int(), rows_per_request.int(), total)
    ones = torch.ones(requests)
    params = up.engine.SamplingKernelInputs(up.engine.LogitsTransformInputs(ones, ones, -ones.int()),
                                            torch.zeros(requests, dtype=torch.uint64), base.int())
    theirs = up.verify.expand_sampling_params_ref(params, to_request, local_step).sample_positions
    step = torch.arange(total) - torch.repeat_interleave(first, rows_per_request)
    ours = sampling.verify_row_positions(torch.repeat_interleave(base, rows_per_request), step)
    return row("seeded draws' counters on verify rows",
               "decoding/sampler.py emit(): hal.ops.sampling.verify_row_positions, base + j * 10000019",
               "sampler.prepare_verification_metadata_ref + expand_sampling_params_ref: base + j * 10000019",
               ours, theirs.long(), None,
               note="share of rows whose sample position differs")


def speculative_rows(up, gen) -> list[dict]:
    """Accept decisions and residual resamples of one verify row per request."""
    count, vocab = 2048, 4096
    target = 2 * torch.randn(count, vocab, generator=gen)
    draft_logprobs = torch.log_softmax(0.7 * target + 0.6 * torch.randn(count, vocab, generator=gen), dim=-1)
    ids = torch.multinomial(draft_logprobs.exp(), 1, generator=gen)[:, 0]
    ids[:16] = -1
    seeds = torch.randint(0, 1 << 62, (count,), generator=gen)
    positions = torch.randint(0, 1 << 20, (count,), generator=gen)
    ones, off = torch.ones(count), torch.zeros(count, dtype=torch.int64)
    _, tokens, accepted, _, _ = _their_sampling(up, target, ones, ones, off, seeds, positions,
                                                is_verify=torch.ones(count, dtype=torch.bool),
                                                last_nextn_token_logprobs=draft_logprobs,
                                                last_next_n_token_ids=ids.int())
    our_accepted, resampled = speculative.speculative_accept(torch.log_softmax(target, dim=-1), draft_logprobs, ids,
                                                             seeds, positions)
    both_rejected = ~our_accepted & ~accepted
    ours, theirs = "hal.ops.speculative.speculative_accept", "fused_sample.fused_sample_ref (reject sampling)"
    return [row("speculative accept decisions", ours, theirs, our_accepted, accepted, None,
                note="same acceptance uniform (seed ^ (3p+2)*golden) and float32 test exp(min(log q - log p, 0)) > u"),
            row("speculative residual resample", ours, theirs, resampled[both_rejected],
                tokens.long()[both_rejected], None,
                note="share of rows rejected by both whose resampled token differs: both draw case 1 from the "
                     "float32 residual max(q - exp(log p - 5e-5), 0)")]

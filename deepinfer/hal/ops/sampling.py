"""Counter-based, batch-invariant token sampling (greedy takes the same path).

Every draw is a pure function of ``(seed, position, case)`` and the row's own probabilities, so
a row's token does not depend on what else is in the batch. The stream is DeepInfer 0.1.0's
PyTorch reference (``random_sampling_ref`` and the reject sampling of ``fused_sample_ref``):

* ``case`` names the draw: ``CASE_SAMPLE = 0`` the normal draw of a token, ``CASE_RESAMPLE = 1``
  the residual resample after a speculative rejection, ``CASE_ACCEPT = 2`` the acceptance
  uniform of speculative verification.
* :func:`draw_uniform`: ``m = (3 * position + case) * GOLDEN_GAMMA`` and the SplitMix64 state
  ``seed + (m ^ (m << 13))`` for token draws (cases 0 and 1), ``seed ^ m`` for the acceptance
  uniform, all in wrapping uint64 arithmetic; the uniform is the top 53 bits of SplitMix64's
  output over ``2**53``.
* :func:`cdf_draw`: the token is the first whose float64 prefix sum of the row's probabilities
  (summed left to right) exceeds ``u * total``, so a token of probability 0 is never drawn.
* Draft sampling draws in its own seed namespace: ``sample(..., namespace=SEED_NAMESPACE_DRAFT)``
  uses ``seed + 1_000_000_007`` (mod ``2**64``), so a draft draw never reuses a target draw.
* The caller chooses ``position``: the position of the token drawn for a prefill or plain decode
  row, ``base + j * VERIFY_ROW_STRIDE`` for row ``j`` of a request's verification rows
  (:func:`verify_row_positions`), and the position the draft token would take for a draft step.

Seeds are uint64 values held in int64 tensors (values ``>= 2**63`` stored as ``value - 2**64``).
DeepInfer's CUDA kernel draws differently (it seeds TileLang's RNG with ``(seed, seq)``), so its
GPU draws are not reproduced; its PyTorch reference is, bit for bit, for the same probabilities
and positions in int32 range (its positions are int32; torch's float64 ``cumsum`` sums left to
right on the CPU).
"""
from __future__ import annotations

import torch

from deepinfer.hal.spec import OpCase, OpSpec, register
from deepinfer.hal.value_checks import value_checks

CASE_SAMPLE, CASE_RESAMPLE, CASE_ACCEPT = 0, 1, 2
SEED_NAMESPACE_TARGET = 0
SEED_NAMESPACE_DRAFT = 1_000_000_007
"""Offsets added to a request's seed: target-model draws, and DSpark draft draws."""
VERIFY_ROW_STRIDE = 10_000_019
"""Row ``j`` of a request's verification rows draws at ``base + j * VERIFY_ROW_STRIDE``
(DeepInfer's ``DRAFT_POS_HASH_MUL``), ``base`` being the position of the token its first row emits."""
FILTER_ORDERS = ("deepinfer", "vllm")
"""Orders of the top-p and top-k filters (:func:`filter_mask`); ``deepinfer`` is the default."""
MIN_TEMPERATURE = 1e-5

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: counter mixing and SplitMix64 step
SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9  # SplitMix64 finalizer (Stafford's Mix13, as in Steele et al. 2014)
SPLITMIX_MUL_2 = 0x94D049BB133111EB
COUNTER_SHIFT = 13  # token draws add m ^ (m << 13) to the seed


def as_int64(value: int) -> int:
    """The int64 with the same 64 bits as the uint64 ``value``."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix_uniform(states: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in ``[0, 1)`` of each uint64 SplitMix64 state (an int64 tensor): in
    wrapping uint64 arithmetic ``z = state + GOLDEN_GAMMA``; ``z = (z ^ z >> 30) * SPLITMIX_MUL_1``;
    ``z = (z ^ z >> 27) * SPLITMIX_MUL_2``; ``z ^= z >> 31``; the result is ``(z >> 11) / 2**53``."""
    z = states + as_int64(GOLDEN_GAMMA)
    z = (z ^ _shift_right_logical(z, 30)) * as_int64(SPLITMIX_MUL_1)
    z = (z ^ _shift_right_logical(z, 27)) * as_int64(SPLITMIX_MUL_2)
    z = z ^ _shift_right_logical(z, 31)
    return _shift_right_logical(z, 11).double() / float(1 << 53)


def draw_uniform(seeds: torch.Tensor, positions: torch.Tensor, case: int) -> torch.Tensor:
    """The uniform float64 in ``[0, 1)`` of draw ``case`` at each ``(seed, position)`` (int64
    tensors of one shape), in wrapping uint64 arithmetic: ``m = (3 * position + case) *
    GOLDEN_GAMMA``; the state is ``seed ^ m`` for ``CASE_ACCEPT`` and ``seed + (m ^ (m << 13))``
    for the token draws; then :func:`splitmix_uniform`."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64 or seeds.shape != positions.shape:
        raise ValueError(f"seeds and positions must be int64 tensors of one shape, got {seeds.dtype} "
                         f"{tuple(seeds.shape)} and {positions.dtype} {tuple(positions.shape)}")
    mixed = (3 * positions + case) * as_int64(GOLDEN_GAMMA)
    if case == CASE_ACCEPT:
        return splitmix_uniform(seeds ^ mixed)
    return splitmix_uniform(seeds + (mixed ^ (mixed << COUNTER_SHIFT)))


def verify_row_positions(base: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Draw positions of verification rows: ``base + row * VERIFY_ROW_STRIDE`` (int64), ``row``
    the row's index among its request's rows (draft ``j``'s row is ``j``, the final row the
    number of drafts) and ``base`` the position of the token the request's first row emits.
    Row 0 (and a request without drafts) draws at the emitted token's position."""
    return base + row * VERIFY_ROW_STRIDE


def namespaced_seeds(seeds: torch.Tensor, namespace: int) -> torch.Tensor:
    """``seeds + namespace`` in wrapping uint64 arithmetic (held in int64): the seeds of a namespace."""
    if not isinstance(namespace, int) or not 0 <= namespace < 1 << 64:
        raise ValueError(f"namespace must be an int in [0, 2**64) (e.g. SEED_NAMESPACE_DRAFT), got {namespace!r}")
    return seeds + as_int64(namespace) if namespace else seeds


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, case: int = CASE_SAMPLE,
           namespace: int = SEED_NAMESPACE_TARGET, filters: bool = True, filter_order: str = "deepinfer"):
    """Draw one token per row; returns ``(token_ids int64 [N], logprobs float32 [N, V])``.

    ``logits``: float ``[N, V]``; per row ``temperature`` (>= 0), ``top_p`` in ``(0, 1]`` (1 is
    off), ``top_k`` (int64; ``<= 0`` or ``>= V`` is off), ``seeds`` and ``positions`` (int64).
    ``z = logits * (1 / max(temperature, 1e-5))`` (the float32 reciprocal, as DeepInfer scales);
    a row with temperature 0 (greedy) keeps only its
    first maximal token, so greedy is exact and its distribution one-hot. Other rows keep the
    tokens :func:`filter_mask` chooses in ``filter_order`` (:data:`FILTER_ORDERS`).
    ``logprobs`` is ``log_softmax`` over the kept tokens, ``-inf`` elsewhere (the processed
    distribution). The token is :func:`cdf_draw` of ``exp(logprobs)`` (float32) with the
    uniform of ``(seed, position, case)`` (:func:`draw_uniform`), so tokens of probability 0 are
    never drawn and a one-hot (greedy) row gives its token.
    ``namespace`` is added to every seed first (:func:`namespaced_seeds`). ``filters=False``
    is the caller's word that no sampled row (temperature > 0) has top-k or top-p on: the two
    filters, which sort every row, are then skipped (same result)."""
    check_sample_args(logits, temperature, top_p, top_k, seeds, positions, case, filter_order)
    seeds = namespaced_seeds(seeds, namespace)
    z = logits.float() * (1.0 / temperature.float().clamp_min(MIN_TEMPERATURE))[:, None]
    keep = filter_mask(z, top_p, top_k, filter_order) if filters else torch.ones_like(z, dtype=torch.bool)
    first_max = torch.zeros_like(keep).scatter_(1, z.argmax(dim=-1, keepdim=True), True)
    keep = torch.where((temperature == 0)[:, None], first_max, keep)
    logprobs = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    return cdf_draw(logprobs.exp(), seeds, positions, case), logprobs


def filter_mask(z: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, filter_order: str) -> torch.Tensor:
    """The tokens top-p and top-k keep of each row of ``z`` (float32 ``[N, V]``), bool ``[N, V]``.

    ``"deepinfer"`` (DeepInfer 0.1.0's order): rank the tokens by ``z`` descending, ties to the
    lower token index (a stable sort). Top-p keeps each token whose *preceding* mass (the
    ``softmax(z)`` probabilities of the tokens ranked before it, summed in float64) is at most
    ``top_p``: the token that crosses ``top_p`` is kept, so is one whose preceding mass equals
    it exactly, and the first token always is. Top-k keeps the first ``k`` ranks, exactly ``k``
    tokens however many tie at the k-th value. A token is kept when both keep it: the first
    ``min(n_p, k)`` ranks, with ``n_p`` the number top-p keeps on the full softmax.

    ``"vllm"`` (top-k, renormalise, then top-p): top-k keeps every token whose ``z`` is at least
    the k-th largest (every tie at the k-th value, as vLLM's top-k does). Top-p then works on
    ``softmax(z)`` over those: ``t`` is the probability of the token at which the descending
    cumulative sum first reaches ``top_p``, and every token of probability ``>= t`` is kept (the
    shortest prefix that reaches ``top_p``, which excludes a token whose preceding mass equals
    ``top_p``, plus every tie with its last token; vLLM cuts such a tie by its sort position)."""
    if filter_order == "deepinfer":
        return _first_ranks_mask(z, top_p, top_k)
    keep = _top_k_mask(z, top_k)
    return keep & _top_p_mask(torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1), top_p)


def cdf_draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, case: int) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (non-negative; rows need not sum to 1), int64: with
    ``c`` the float64 prefix sums of the row (``probs`` cast to float64, summed left to right),
    ``u = draw_uniform(seed, position, case)`` and ``target = u * c[-1]`` (float64), the first
    token with ``c > target``. A token of probability 0 adds nothing to ``c``, so it is never
    drawn; a row with no mass gives token 0."""
    cumulative = probs.double().cumsum(dim=-1)
    target = draw_uniform(seeds, positions, case) * cumulative[:, -1]
    token = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    return token.masked_fill(token == probs.shape[-1], 0)


def _top_k_mask(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    descending = torch.sort(z, dim=-1, descending=True).values
    kth = descending.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
    return (z >= kth) | ~active[:, None]


def _top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    descending = torch.sort(probs, dim=-1, descending=True).values
    below = (descending.cumsum(dim=-1) < top_p.float()[:, None]).sum(dim=-1, keepdim=True)
    threshold = descending.gather(1, below.clamp_max(probs.shape[1] - 1))
    return (probs >= threshold) | (top_p >= 1.0)[:, None]


def _first_ranks_mask(z: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = z.shape[1]
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    probs = torch.softmax(z, dim=-1).gather(1, order).double()
    preceding = torch.cat((torch.zeros_like(probs[:, :1]), probs.cumsum(dim=-1)[:, :-1]), dim=1)
    by_mass = (preceding <= top_p.double()[:, None]).sum(dim=-1)
    by_mass = torch.where(top_p >= 1.0, vocab, by_mass)
    by_count = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kept_ranks = torch.arange(vocab, device=z.device) < torch.minimum(by_mass, by_count)[:, None]
    return torch.zeros_like(kept_ranks).scatter_(1, order, kept_ranks)


def check_sample_args(logits, temperature, top_p, top_k, seeds, positions, case, filter_order) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [N, V] tensor, got {logits.dtype} "
                         f"of shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    for name, tensor, integer in (("temperature", temperature, False), ("top_p", top_p, False),
                                  ("top_k", top_k, True), ("seeds", seeds, True), ("positions", positions, True)):
        wrong_dtype = tensor.dtype != torch.int64 if integer else not tensor.is_floating_point()
        if wrong_dtype or tensor.shape != (rows,):
            kind = "an int64" if integer else "a float"
            raise ValueError(f"{name} must be {kind} tensor of shape [N={rows}], got {tensor.dtype} "
                             f"of shape {tuple(tensor.shape)}")
    if value_checks() and not bool((temperature >= 0).all()):
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    if value_checks() and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p.tolist()}")
    if case not in (CASE_SAMPLE, CASE_RESAMPLE, CASE_ACCEPT):
        raise ValueError(f"case must be 0 (sample), 1 (resample) or 2 (accept), got {case}")
    if filter_order not in FILTER_ORDERS:
        raise ValueError(f"filter_order={filter_order!r} is not a filter order; use one of {list(FILTER_ORDERS)} "
                         f"(deepinfer: top-p on the full softmax, then exactly top-k; vllm: top-k keeping ties, "
                         f"renormalise, then top-p)")


def _case(vocab: int, temperature, top_p, top_k, case: int = CASE_SAMPLE, scale: float = 2.0,
          spikes: int = 0, tied: bool = False, plateaus=(), filter_order: str = "deepinfer"):
    """Random logits (``tied``: integers 0-2; ``spikes`` tokens near 20). ``plateaus[r] > 0`` makes
    row ``r`` that many equal logits at random columns and ``-inf`` elsewhere, whose probabilities
    (a power of two's reciprocal) and their sums are exact on any hardware."""
    def make(gen: torch.Generator, device: torch.device):
        rows = len(temperature)
        if tied:
            logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()
        else:
            logits = scale * torch.randn(rows, vocab, generator=gen)
        if spikes:
            columns = torch.randint(0, vocab, (rows, spikes), generator=gen)
            logits.scatter_(1, columns, 20 + 2 * torch.randn(rows, spikes, generator=gen))
        for row, count in enumerate(plateaus):
            if count:
                logits[row] = float("-inf")
                logits[row, torch.randperm(vocab, generator=gen)[:count]] = 1.5
        return {
            "logits": logits.to(device),
            "temperature": torch.tensor(temperature, device=device),
            "top_p": torch.tensor(top_p, device=device),
            "top_k": torch.tensor(top_k, device=device),
            "seeds": torch.randint(-(1 << 62), 1 << 62, (rows,), generator=gen).to(device),
            "positions": torch.randint(0, 1 << 20, (rows,), generator=gen).to(device),
            "case": case,
            "filter_order": filter_order,
        }
    return make


def _in_both_orders(name: str, *args, size: str = "tiny", **options) -> tuple[OpCase, OpCase]:
    """The case ``name`` in the default (deepinfer) filter order and ``<name>_vllm_order``."""
    return (OpCase(name, _case(*args, **options), size=size),
            OpCase(f"{name}_vllm_order", _case(*args, **options, filter_order="vllm"), size=size))


register(OpSpec(
    name="sample",
    activations=False,
    summary="temperature / top-k / top-p sampling with a counter-based RNG and float64 CDF inversion",
    reference=sample,
    cases=(
        *_in_both_orders("tiny_mixed", 11, [1.0, 0.7, 1.3, 0.5, 2.0, 1.0], [1.0, 0.9, 0.6, 1.0, 0.8, 0.3],
                         [0, 3, -1, 5, 11, 2]),
        OpCase("tiny_greedy", _case(11, [0.0, 0.0, 0.0, 1e-6], [1.0, 1.0, 0.5, 1.0], [-1, 0, 4, -1])),
        *_in_both_orders("tiny_top_k_ties", 11, [1.0, 0.5, 1.0, 2.0, 1.0], [1.0, 1.0, 0.7, 1.0, 0.9],
                         [2, 3, 4, 1, 6], tied=True),
        # 4 or 8 equal tokens: top-p lands exactly on a multiple of 1/4 or 1/8 of the mass
        *_in_both_orders("tiny_top_p_boundary", 16, [1.0, 0.7, 1.0, 1.0, 2.0, 1.0],
                         [0.25, 0.5, 0.75, 0.5, 0.375, 0.125], [0, 0, 0, 0, 3, 0], plateaus=[4, 4, 4, 8, 8, 8]),
        *_in_both_orders("tiny_top_p_and_top_k", 64, [1.0, 0.8, 1.0, 1.5, 1.0, 1.0, 0.6],
                         [0.6, 0.9, 0.3, 0.95, 0.5, 0.8, 0.5], [5, 3, 10, 20, 2, 63, 3], plateaus=[0] * 6 + [8]),
        OpCase("tiny_resample", _case(11, [1.0, 0.8, 1.0], [1.0, 0.95, 0.5], [0, 6, 0], case=CASE_RESAMPLE)),
        *_in_both_orders("v41_vocab", 129280, [1.0, 0.6, 1.0, 0.0], [0.9, 1.0, 0.95, 1.0], [0, 50, 1000, -1],
                         scale=1.0, spikes=8, size="real"),
    ),
))

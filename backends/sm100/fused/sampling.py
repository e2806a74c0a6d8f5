"""Token sampling in one Triton program per row, passes over the vocabulary in blocks (each lane
of a block accumulates on its own; the lanes are combined once a pass ends):

1. the row's max, first argmax and online sum of ``exp(z - max)``, ``z`` kept in the ``logprobs``
   row as scratch when a filter is on;
2. top-k rows: four 8-bit radix-select passes (``tl.histogram``) for the k-th largest order key;
3. DeepInfer's order (``DEEPINFER``), the kept tokens being the first ``n`` by (``z`` descending,
   index ascending):
   a. top-p rows: the float64 sum of ``e = exp(z - max)`` over the row (the full softmax), then a
      bisection over ``z``'s order key, from the top-k key up, for the smallest key whose first
      token has fewer than k tokens above it and at most ``top_p`` of probability mass above it:
      at most 32 passes, fewer the more the row's keys are spread out;
   b. one pass counting the tokens and summing the mass above that key, so how many of its ties
      are kept (as many as fit top-k and top-p), then the index of the last kept tie: a
      block-wise ``tl.cumsum`` that stops at its block;
4. the vLLM order: ``e`` over the top-k-kept tokens, summed (and stored), then for top-p rows a
   bisection over the probability's bits for the largest ``v`` with ``sum(p >= v) >= top_p``
   (float64 sums), the bracket tightened to the row's keys each pass: at most 31 passes;
5. ``logprobs`` written and ``exp(logprobs)`` summed in float64, block after block;
6. sampled rows: the drawn token, the first of positive probability whose float64 prefix sum
   exceeds ``u * total``: a block-wise ``tl.cumsum`` that stops at the token's block. A
   ``tl.cumsum`` sums in a tree, not left to right as the reference's ``cumsum``, so the two can
   part only where ``u * total`` falls within float64 rounding of a token's boundary.

So 3 passes for a row without filters (2 when greedy; the draw's pass stops early). With top-k
alone, 8 in the vLLM order and 8 plus the tie cut's partial one in DeepInfer's; with top-p, 4 (vLLM)
or 5 and the partial one (DeepInfer) plus the bisection; with both, 8 (vLLM) or 9 and the partial
one (DeepInfer) plus the bisection.
"""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.hal.ops import sampling

BLOCK_VOCAB = 8192
NUM_WARPS = 32
GOLDEN_GAMMA: tl.constexpr = tl.constexpr(sampling.GOLDEN_GAMMA)
SPLITMIX_MUL_1: tl.constexpr = tl.constexpr(sampling.SPLITMIX_MUL_1)
SPLITMIX_MUL_2: tl.constexpr = tl.constexpr(sampling.SPLITMIX_MUL_2)
MIN_TEMPERATURE: tl.constexpr = tl.constexpr(sampling.MIN_TEMPERATURE)
COUNTER_SHIFT: tl.constexpr = tl.constexpr(sampling.COUNTER_SHIFT)
CASE_ACCEPT: tl.constexpr = tl.constexpr(sampling.CASE_ACCEPT)
UNIFORM_STEP: tl.constexpr = tl.constexpr(2.0 ** -53)


@triton.jit
def draw_uniform(seed, position, CASE: tl.constexpr, NAMESPACE: tl.constexpr):
    """:func:`deepinfer.hal.ops.sampling.draw_uniform` of ``(seed + NAMESPACE, position, CASE)``,
    bit for bit: the counter mix and SplitMix64 in wrapping uint64 arithmetic, a float64 in ``[0, 1)``."""
    seed = seed.to(tl.uint64, bitcast=True) + NAMESPACE
    mixed = (3 * position + CASE).to(tl.uint64, bitcast=True) * GOLDEN_GAMMA
    if CASE == CASE_ACCEPT:
        z = seed ^ mixed
    else:
        z = seed + (mixed ^ (mixed << COUNTER_SHIFT))
    z = z + GOLDEN_GAMMA
    z = (z ^ (z >> 30)) * SPLITMIX_MUL_1
    z = (z ^ (z >> 27)) * SPLITMIX_MUL_2
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * UNIFORM_STEP


@triton.jit
def draw_block(probs, offs, inside, running, target, vocab):
    """One block of the CDF draw: the first token of the block of positive float64 ``probs``
    whose prefix sum (``running`` + this block's ``tl.cumsum``) exceeds ``target`` (``vocab`` if
    none), and ``running`` past the block."""
    cumulative = running + tl.cumsum(probs, 0)
    token = tl.min(tl.where(inside & (probs > 0) & (cumulative > target), offs, vocab))
    return token, running + tl.sum(probs)


@triton.jit
def _order_key(z):
    """int64 in ``[0, 2**32)`` ordered as the float32 ``z`` (-0.0 as +0.0)."""
    bits = z.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _scaled(src, offs, inside, inv_temperature):
    """``z = logits * inv_temperature`` in float32 (the reciprocal rounded once), -inf past the row."""
    return tl.load(src + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature


@triton.jit
def _max_pass(src, scratch, vocab, inv_temperature, keep_z, BLOCK: tl.constexpr):
    """Max of ``z``, the online ``sum(exp(z - max))`` and the first argmax (each lane of the block
    on its own, combined at the end); ``z`` stored in ``scratch`` when ``keep_z``."""
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    first = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        z = _scaled(src, offs, inside, inv_temperature)
        tl.store(scratch + offs, z, mask=inside & keep_z)
        new_top = tl.maximum(top, z)
        rescale = tl.where(top == new_top, 1.0, tl.exp(top - new_top))
        total = total * rescale + tl.where(z > float("-inf"), tl.exp(z - new_top), 0.0)
        first = tl.where(z > top, offs, first)
        top = new_top
    row_top = tl.max(top)
    total = tl.sum(total * tl.where(top > float("-inf"), tl.exp(top - row_top), 0.0))
    return row_top, total, tl.min(tl.where(top == row_top, first, vocab))


@triton.jit
def _top_k_key(scratch, vocab, k, BLOCK: tl.constexpr):
    """Order key of the k-th largest ``z`` of ``scratch``: radix select, 8 bits a pass."""
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int64)
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        counts = tl.zeros([256], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            key = _order_key(tl.load(scratch + offs, mask=inside, other=0.0))
            match = inside & ((key >> (shift + 8)) == prefix)
            counts += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts
        digit = tl.max(tl.where(above + at_or_above >= k, digits, 0))
        above += tl.sum(tl.where(digits > digit, counts, 0))
        prefix = prefix * 256 + digit
    return prefix


@triton.jit
def _kept_exp_pass(scratch, vocab, top, kth, store, BLOCK: tl.constexpr):
    """``e = exp(z - top)`` where ``z``'s key is at least ``kth`` (else 0), over ``z`` in
    ``scratch`` (replaced by ``e`` when ``store``): the float64 sum of ``e`` and its max."""
    total = tl.zeros([BLOCK], tl.float64)
    largest = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        z = tl.load(scratch + offs, mask=inside, other=float("-inf"))
        e = tl.where(inside & (_order_key(z) >= kth), tl.exp(z - top), 0.0)
        tl.store(scratch + offs, e, mask=inside & store)
        total += e.to(tl.float64)
        largest = tl.maximum(largest, e)
    return tl.sum(total), tl.max(largest)


@triton.jit
def _top_p_key(scratch, vocab, inv_mass, top_p, mass, largest, BLOCK: tl.constexpr):
    """The largest probability bits ``v`` with ``sum(p >= v) >= top_p`` (``p = e * inv_mass``
    over ``e`` in ``scratch``; 0, all kept, when none reaches it) and the sum of ``e`` kept."""
    low = tl.zeros([], tl.int32)
    high = (largest * inv_mass).to(tl.int32, bitcast=True) + 1
    while high - low > 1:
        mid = low + (high - low) // 2
        reached = tl.zeros([BLOCK], tl.float64)
        kept = tl.zeros([BLOCK], tl.float64)
        above = tl.zeros([BLOCK], tl.int32) + high
        below = tl.zeros([BLOCK], tl.int32) + low
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            e = tl.load(scratch + offs, mask=inside, other=0.0)
            p = e * inv_mass
            key = p.to(tl.int32, bitcast=True)
            upper = inside & (key >= mid)
            reached += tl.where(upper, p.to(tl.float64), 0.0)
            kept += tl.where(upper, e.to(tl.float64), 0.0)
            above = tl.minimum(above, tl.where(upper & (key < high), key, high))
            below = tl.maximum(below, tl.where(inside & (key >= low) & (key < mid), key, low))
        ok = tl.sum(reached).to(tl.float32) >= top_p
        low = tl.where(ok, tl.minimum(tl.min(above), high - 1), low)
        mass = tl.where(ok, tl.sum(kept), mass)
        high = tl.where(ok, high, tl.max(below) + 1)
    return low, mass


@triton.jit
def _first_ranks_key(scratch, vocab, top, inv_mass, top_p, k, low, high, BLOCK: tl.constexpr):
    """The smallest order key ``t`` of ``z`` (in ``scratch``) with fewer than ``k`` tokens above it
    and at most ``top_p`` of probability mass (``p = exp(z - top) * inv_mass``, float64 sums)
    above it: where DeepInfer's kept ranks end. ``low`` is a key that fails (or -1), ``high`` a
    row's key that passes; each pass moves them to the row's keys around the midpoint."""
    while high - low > 1:
        mid = low + (high - low) // 2
        count = tl.zeros([BLOCK], tl.int32)
        mass = tl.zeros([BLOCK], tl.float64)
        below = tl.zeros([BLOCK], tl.int64) - 1
        above = tl.zeros([BLOCK], tl.int64) + high
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            z = tl.load(scratch + offs, mask=inside, other=float("-inf"))
            key = _order_key(z)
            upper = inside & (key > mid)
            count += upper.to(tl.int32)
            mass += tl.where(upper, (tl.exp(z - top) * inv_mass).to(tl.float64), 0.0)
            below = tl.maximum(below, tl.where(inside & (key <= mid), key, -1))
            above = tl.minimum(above, tl.where(upper, key, high))
        ok = (tl.sum(count) < k) & (tl.sum(mass) <= top_p.to(tl.float64))
        below_key = tl.max(below)
        above_key = tl.min(above)
        high, low = (tl.where(ok & (below_key >= 0), below_key, tl.where(ok, above_key, high)),
                     tl.where(ok & (below_key >= 0), low, above_key - 1))
    return high


@triton.jit
def _tie_cut(scratch, vocab, top, inv_mass, top_p, by_p, k, key, BLOCK: tl.constexpr):
    """For DeepInfer's last kept key ``key``: the index of the last of its ties that is kept (in
    index order, as many as top-k and top-p leave room for, at least one) and the float64 sum of
    ``exp(z - top)`` over the kept tokens."""
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float64)
    kept = tl.zeros([BLOCK], tl.float64)
    ties = tl.zeros([BLOCK], tl.int32)
    tie_e = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        z = tl.load(scratch + offs, mask=inside, other=float("-inf"))
        e = tl.exp(z - top)
        order_key = _order_key(z)
        upper = inside & (order_key > key)
        tie = inside & (order_key == key)
        count += upper.to(tl.int32)
        mass += tl.where(upper, (e * inv_mass).to(tl.float64), 0.0)
        kept += tl.where(upper, e.to(tl.float64), 0.0)
        ties += tie.to(tl.int32)
        tie_e = tl.maximum(tie_e, tl.where(tie, e, 0.0))
    above, above_mass, tie_count, e_tie = tl.sum(count), tl.sum(mass), tl.sum(ties), tl.max(tie_e)
    kept_above = tl.sum(kept)
    take = tl.minimum(tie_count.to(tl.int64), k - above)
    p_tie = (e_tie * inv_mass).to(tl.float64)
    limit = top_p.to(tl.float64)
    if by_p & (p_tie > 0):
        fit = tl.minimum((limit - above_mass) / p_tie, tie_count.to(tl.float64))
        fits = tl.maximum(tl.floor(fit), 0.0).to(tl.int64) + 1
        while (fits > 1) & (above_mass + (fits - 1).to(tl.float64) * p_tie > limit):
            fits -= 1
        while (fits < tie_count) & (above_mass + fits.to(tl.float64) * p_tie <= limit):
            fits += 1
        take = tl.minimum(take, fits)
    take = tl.maximum(take, 1).to(tl.int32)
    cut = tl.zeros([], tl.int32) + vocab
    running = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)
    while (cut == vocab) & (start < vocab):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        tie = inside & (_order_key(tl.load(scratch + offs, mask=inside, other=float("-inf"))) == key)
        cumulative = running + tl.cumsum(tie.to(tl.int32), 0)
        cut = tl.min(tl.where(tie & (cumulative == take), offs, vocab))
        running += tl.sum(tie.to(tl.int32))
        start += BLOCK
    return cut, kept_above + take.to(tl.float64) * e_tie.to(tl.float64)


@triton.jit
def _write_pass(src, out, vocab, inv_temperature, top, log_mass, kth, cut, p_key, inv_mass, greedy, first,
                FILTERS: tl.constexpr, BLOCK: tl.constexpr):
    """``logprobs = z - top - log_mass`` over the kept tokens (-inf elsewhere) into ``out``: those
    whose order key is above ``kth``, or equal to it at an index up to ``cut``, with probability
    bits at least ``p_key``. Returns the float64 sum of ``exp(logprobs)``, block after block as the
    draw sums them, and the last token of positive probability."""
    total = tl.zeros([], tl.float64)
    last = tl.zeros([], tl.int32) - 1
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        z = _scaled(src, offs, inside, inv_temperature)
        keep = inside
        if FILTERS:
            probability_key = (tl.exp(z - top) * inv_mass).to(tl.int32, bitcast=True)
            key = _order_key(z)
            keep = keep & ((key > kth) | ((key == kth) & (offs <= cut))) & (probability_key >= p_key)
        keep = tl.where(greedy, offs == first, keep)
        logprobs = tl.where(keep, (z - top) - log_mass, float("-inf"))
        tl.store(out + offs, logprobs, mask=inside)
        probs = tl.exp(logprobs).to(tl.float64)
        total += tl.sum(probs)
        last = tl.maximum(last, tl.max(tl.where(probs > 0, offs, -1)))
    return total, last


@triton.jit
def sample_kernel(logits, temperature, top_p, top_k, seeds, positions, token_ids, logprobs, vocab, logits_stride,
                  CASE: tl.constexpr, NAMESPACE: tl.constexpr, FILTERS: tl.constexpr, DEEPINFER: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Row ``pid`` of the HAL ``sample`` (``DEEPINFER``: filter order ``deepinfer``, else ``vllm``):
    ``token_ids[pid]`` and ``logprobs[pid, :vocab]`` (the row doubles as scratch until it is written)."""
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * logits_stride
    out = logprobs + row * vocab
    temp = tl.load(temperature + row)
    greedy = temp == 0
    inv_temperature = tl.math.div_rn(1.0, tl.maximum(temp.to(tl.float32), MIN_TEMPERATURE))
    k = tl.load(top_k + row)
    p_limit = tl.load(top_p + row)
    by_k = FILTERS & (temp != 0) & (k > 0) & (k < vocab)
    by_p = FILTERS & (temp != 0) & (p_limit < 1.0)
    top, total, first = _max_pass(src, out, vocab, inv_temperature, by_k | by_p, BLOCK)
    log_mass = tl.where(greedy, 0.0, tl.log(total))
    kth = tl.zeros([], tl.int64)
    cut = tl.zeros([], tl.int32) + vocab
    p_key = tl.zeros([], tl.int32)
    inv_mass = tl.zeros([], tl.float32)
    if FILTERS:
        if by_k:
            tl.debug_barrier()
            kth = _top_k_key(out, vocab, k, BLOCK)
        if DEEPINFER:
            if by_k | by_p:
                if by_p:
                    tl.debug_barrier()
                    mass, _ = _kept_exp_pass(out, vocab, top, 0, False, BLOCK)
                    inv_mass = tl.math.div_rn(1.0, mass.to(tl.float32))
                    limit = tl.where(by_k, k, vocab + 1)
                    kth = _first_ranks_key(out, vocab, top, inv_mass, p_limit.to(tl.float32), limit,
                                           tl.where(by_k, kth - 1, -1), _order_key(top), BLOCK)
                tl.debug_barrier()
                cut, mass = _tie_cut(out, vocab, top, inv_mass, p_limit.to(tl.float32), by_p, tl.where(by_k, k, vocab),
                                     kth, BLOCK)
                log_mass = tl.log(mass.to(tl.float32))
        elif by_k | by_p:
            tl.debug_barrier()
            mass, largest = _kept_exp_pass(out, vocab, top, kth, by_p, BLOCK)
            inv_mass = tl.math.div_rn(1.0, mass.to(tl.float32))
            if by_p:
                tl.debug_barrier()
                p_key, mass = _top_p_key(out, vocab, inv_mass, p_limit.to(tl.float32), mass, largest, BLOCK)
            log_mass = tl.log(mass.to(tl.float32))
    tl.debug_barrier()
    total, last = _write_pass(src, out, vocab, inv_temperature, top, log_mass, kth, cut, p_key, inv_mass, greedy, first, FILTERS,
                              BLOCK)
    token = first
    if temp != 0:
        tl.debug_barrier()
        target = draw_uniform(tl.load(seeds + row), tl.load(positions + row), CASE, NAMESPACE) * total
        token = tl.zeros([], tl.int32) + vocab
        running = tl.zeros([], tl.float64)
        start = tl.zeros([], tl.int32)
        while (token == vocab) & (start < vocab):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            probs = tl.exp(tl.load(out + offs, mask=inside, other=float("-inf"))).to(tl.float64)
            token, running = draw_block(probs, offs, inside, running, target, vocab)
            start += BLOCK
        token = tl.where(token == vocab, last, token)  # the block tree sums left no token past the target
    tl.store(token_ids + row, token.to(tl.int64))


def main() -> None:
    """Check the sampling and speculative-acceptance kernels against the OpSpec references on this
    GPU (:mod:`deepinfer_backends.sm100.selfcheck`)."""
    from deepinfer_backends.sm100.selfcheck import run

    run("sample", "speculative_accept")


if __name__ == "__main__":
    main()

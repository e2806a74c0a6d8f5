"""Greedy decoding against DeepInfer 0.1.0's (issue 29). DeepInfer has no temperature-0 path: it
samples at temperature 1e-5. We keep exact greedy: temperature 0 takes the first maximal logit.
The two agree whenever the maximum is distinct; on a tie between top logits DeepInfer's draw picks
any of the tied tokens, ours always the first."""
import torch

from deepinfer.hal.ops.sampling import sample


def _draws(logits: list[float], temperature: float, rows: int = 64) -> set[int]:
    """The tokens ``sample`` draws for ``rows`` copies of one row of ``logits``, each its own seed."""
    batch = torch.tensor([logits] * rows)
    tokens, _ = sample(batch, torch.full((rows,), temperature), torch.ones(rows), torch.full((rows,), -1),
                       torch.arange(rows), torch.zeros(rows, dtype=torch.int64))
    return set(tokens.tolist())


def test_greedy_takes_the_first_of_tied_maxima():
    # logits [1, 3, 3, 0]: tokens 1 and 2 tie at the maximum; greedy is token 1 for every seed
    assert _draws([1.0, 3.0, 3.0, 0.0], temperature=0.0) == {1}


def test_a_temperature_of_1e_5_splits_a_tie_as_deepinfer_does():
    # at T = 1e-5 the tied pair holds all the mass, 1/2 each: seeds pick both tokens, never the others
    assert _draws([1.0, 3.0, 3.0, 0.0], temperature=1e-5) == {1, 2}


def test_a_distinct_maximum_is_the_same_token_either_way():
    # logits [1, 3, 2.9, 0]: at T = 1e-5 token 1 outweighs token 2 by exp(0.1 / 1e-5): greedy's token
    assert _draws([1.0, 3.0, 2.9, 0.0], temperature=0.0) == _draws([1.0, 3.0, 2.9, 0.0], temperature=1e-5) == {1}

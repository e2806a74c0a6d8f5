"""Shared helpers: a random tiny model, and running sequences through it with paged caches."""
from __future__ import annotations

import math

import torch

from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS, DeepseekV41Config
from deepinfer.models.deepseek_v41.engram_vocab import CompressedVocab
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import init_random_weights
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.registry import build_config, model_preset


def tiny_config(**overrides) -> DeepseekV41Config:
    preset = model_preset("tiny_random")
    preset["config"].update(overrides)
    return build_config(preset)


ENGRAM = dict(engram_layer_ids=[0, 3], engram_max_ngram_size=3, engram_vocab_size=37, engram_n_heads=2,
              engram_head_dim=32, engram_compressed_vocab_size=512)
"""Engram on the tiny_random layout: the first layer and a YOCO consumer, orders 2 and 3, two heads."""


def tiny_model(seed: int = 0, backend: str = "reference", batch_invariant: bool = False,
               **overrides) -> DeepseekV41ForCausalLM:
    """A random tiny model; with ``batch_invariant`` its ops compute each row the same way
    whatever the step's shape, so chunked and full forwards give bitwise equal logits."""
    model = DeepseekV41ForCausalLM(tiny_config(**overrides), OpTable(backend, batch_invariant=batch_invariant),
                                   max_model_len=1024)
    return init_random_weights(model, seed)


def tiny_engram_model(seed: int = 3, vocab: CompressedVocab | None = None, batch_invariant: bool = True,
                      **overrides) -> DeepseekV41ForCausalLM:
    """A random tiny model with :data:`ENGRAM` (and ``overrides``) on the reference backend; by
    default with batch-invariant ops, so that other step shapes give bitwise equal logits, and the
    identity compressed vocabulary."""
    cfg = tiny_config(**{**ENGRAM, **overrides})
    vocab = vocab or CompressedVocab.identity(cfg.vocab_size)
    model = DeepseekV41ForCausalLM(cfg, OpTable("reference", batch_invariant=batch_invariant), max_model_len=256,
                                   engram_vocab=vocab)
    return init_random_weights(model, seed)


class SequenceRunner:
    """Feeds sequences through a model with its own caches: block tables and state slots are
    handed out per sequence (block 0 is never used, as in the engine)."""

    def __init__(self, model: DeepseekV41ForCausalLM, num_seqs: int, max_len: int):
        self.model = model
        self.blocks_per_seq = math.ceil(max_len / PAGE_TOKENS)
        self.caches = model.allocate_caches(1 + num_seqs * self.blocks_per_seq, num_seqs + 1)
        self.lengths = [0] * num_seqs

    def blocks(self, seq: int) -> list[int]:
        return list(range(1 + seq * self.blocks_per_seq, 1 + (seq + 1) * self.blocks_per_seq))

    def step(self, chunks: dict[int, list[int]], decode: bool = False, all_logits: bool = False) -> torch.Tensor:
        """Append ``chunks[seq]`` to each listed sequence; returns the logits rows."""
        seqs = sorted(chunks)
        ctx = ForwardContext.for_sequences(
            [chunks[s] for s in seqs], [self.lengths[s] for s in seqs], [s + 1 for s in seqs],
            [self.blocks(s) for s in seqs], decode=decode, all_logits=all_logits)
        with torch.no_grad():
            logits = self.model(ctx, self.caches)
        for s in seqs:
            self.lengths[s] += len(chunks[s])
        return logits

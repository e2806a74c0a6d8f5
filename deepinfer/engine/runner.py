"""ModelRunner: turns a scheduled batch into one forward pass over the paged caches."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from deepinfer.decoding.sampler import SlotTokens
from deepinfer.engine.device import Runtime
from deepinfer.engine.graphs import PaddedPass, as_float, float_bits, graph_batch_sizes, graph_table_widths
from deepinfer.engine.request import PLACEHOLDER
from deepinfer.engine.scheduler import Batch
from deepinfer.hal.ops.sampling import as_int64
from deepinfer.hal.value_checks import skip_value_checks
from deepinfer.models.forward_context import ForwardContext, upload_arrays
from deepinfer.models.interface import DraftProposal, DraftSampling, GenerativeModel
from deepinfer.parallel.context import from_first_rank, shard_context


class ModelRunner:
    """Owns the model's caches on one device and runs its passes.

    Every forward runs without value checks (the engine validates its inputs on the host) and
    its metadata goes up in one transfer. With ``padded_decode``, decode steps (one token per
    sequence), verify steps (``num_draft_tokens + 1`` per sequence) and draft passes run over
    batches padded to :func:`graph_batch_sizes`, from CUDA graphs once :meth:`capture_graphs`
    has run; each kind is built for every width of :func:`graph_table_widths`, and a step
    runs at the narrowest that holds its sequences' blocks. With ``num_draft_tokens`` every forward also fills the DSpark draft layers' main
    caches, and draft passes draw with ``filter_order`` (``decoding.filter_order``). ``logits_trace``: set it to a dict (debugging, invariance tests) and each step's
    logits rows are appended there under their request id. ``bounded_replay`` (an
    ``engine.bounded_replay`` config): the kept suffix is counted from each request's own
    prompt, so a request recomputed after preemption replays as it first did. ``slots``
    (:class:`~deepinfer.decoding.sampler.SlotTokens`) is what each request's last step left on the
    device: a decode-shaped pass reads an input token < 0 (a
    :data:`~deepinfer.engine.request.PLACEHOLDER`) there (the first from ``last``, the j-th
    draft from ``drafts``), and a chained sequence's start from ``length``. ``context``
    (:class:`~deepinfer.parallel.groups.ProcessGroups` with a ``context`` group; None: one
    process) splits each prefill step's rows over the context-parallel ranks
    (:mod:`deepinfer.parallel.context`), and every rank samples from the first rank's logits and
    drafts."""

    def __init__(self, model: GenerativeModel, runtime: Runtime, num_blocks: int, num_state_slots: int,
                 max_num_seqs: int, num_draft_tokens: int = 0,
                 confidence_temperature: float | tuple[float, ...] = 1.0,
                 bounded_replay=None, padded_decode: bool = False, filter_order: str = "deepinfer",
                 context=None):
        self.model, self.runtime, self.context = model, runtime, context
        self.bounded_replay = bounded_replay
        self.replay = bounded_replay if bounded_replay is not None and bounded_replay.mode != "off" else None
        self.k, self.confidence_temperature = num_draft_tokens, confidence_temperature
        self.filter_order = filter_order
        self.caches = model.allocate_caches(num_blocks, num_state_slots)
        self.slots = SlotTokens.zeros(num_state_slots, num_draft_tokens, runtime.device)
        self.table_width = math.ceil((model.max_model_len + model.position_margin) / model.page_tokens)
        self.logits_trace: dict[int, list[torch.Tensor]] | None = None
        self.passes: dict[tuple[str, int], PaddedPass] = {}
        if padded_decode:
            for width in graph_table_widths(self.table_width):
                self._build_passes(graph_batch_sizes(max_num_seqs), width)

    def run(self, batch: Batch) -> torch.Tensor:
        """float32 logits of the rows that emit tokens: for each sampling chunk in order, one row
        per verified draft plus its final row."""
        chunks = batch.chunks
        padded = self._padded_pass(batch)
        if padded is not None:
            logits = padded(len(chunks), self._sequence_arrays(chunks, padded.fields["table"]))["logits"]
        else:
            with skip_value_checks(), torch.no_grad():
                logits = self.model(self._context(batch), self.caches)
        if self.context is not None:
            from_first_rank(logits, self.context.context)
        if self.logits_trace is not None:
            row = 0
            for chunk in (c for c in chunks if c.samples):
                rows = len(chunk.drafts) + 1
                trace = self.logits_trace.setdefault(chunk.request.request_id, [])
                trace.append(logits[row:row + rows].to("cpu", copy=True))
                row += rows
        return logits

    def draft(self, chunks: Sequence) -> DraftProposal:
        """One DSpark draft pass, queued right after the step of ``chunks`` (sampling chunks):
        each request's input is the token that step emitted, at the length it left, both read
        on the device; sampled with each request's own parameters and seed. The drafts are also
        left in ``slots.drafts``, where the next step's placeholders read them."""
        k, requests = self.k, [c.request for c in chunks]
        padded = self._pass_for("draft", len(chunks), max(len(c.blocks) for c in chunks))
        arrays = self._sequence_arrays_of([[PLACEHOLDER] + [self.model.draft_noise_token] * (k - 1)] * len(chunks),
                                          [0] * len(chunks), [c.slot for c in chunks], [c.blocks for c in chunks],
                                          requests, padded.fields["table"] if padded is not None else self.table_width,
                                          chained=[True] * len(chunks))
        params = [r.params for r in requests]
        arrays.update(temperature=float_bits([p.temperature for p in params]),
                      top_p=float_bits([p.top_p for p in params]), top_k=[r.top_k for r in requests],
                      seed=[as_int64(r.seed) for r in requests])
        if padded is not None:
            out = padded(len(requests), arrays)
            proposal = DraftProposal(out["tokens"].clone(), out["logprobs"].clone(), out["confidences"].clone())
        else:
            moved = upload_arrays(arrays, self.runtime.device, self.runtime.upload)
            inputs = {name: values.view(len(requests), -1) for name, values in moved.items()}
            with skip_value_checks(), torch.no_grad():
                out = self._draft_pass(inputs)
            proposal = DraftProposal(out["tokens"], out["logprobs"], out["confidences"])
        if self.context is not None:
            for part in (proposal.tokens, proposal.logprobs, proposal.confidences):
                from_first_rank(part, self.context.context)
            slots = torch.as_tensor([c.slot for c in chunks], device=proposal.tokens.device)
            self.slots.drafts.index_copy_(0, slots, proposal.tokens)
        return proposal

    def capture_graphs(self, progress: Callable[[], None] = lambda: None) -> None:
        """Record every padded pass at every size (after one eager warm-up each)."""
        for padded in self.passes.values():
            padded.capture(progress)

    @property
    def num_graphs(self) -> int:
        return sum(len(p.sizes) for p in self.passes.values())

    def _build_passes(self, sizes: list[int], width: int) -> None:
        sequence = {"start": 1, "slot": 1, "table": width}
        if self.k:
            sequence["chained"] = 1
        if self.replay is not None:
            sequence["replay"] = 1
        kinds = {"decode": (self._target_pass(1), {"ids": 1})}
        if self.k:
            sampling = {"temperature": 1, "top_p": 1, "top_k": 1, "seed": 1}
            kinds["verify"] = (self._target_pass(self.k + 1), {"ids": self.k + 1})
            kinds["draft"] = (self._draft_pass, {"ids": self.k, **sampling})
        for kind, (fn, fields) in kinds.items():
            self.passes[kind, width] = PaddedPass(f"{kind} (table width {width})", fn, {**fields, **sequence}, sizes,
                                                  self.runtime)

    def _pass_for(self, kind: str, count: int, blocks: int) -> PaddedPass | None:
        """The narrowest padded pass of ``kind`` for ``count`` sequences of up to ``blocks`` blocks."""
        fitting = [p for (k, width), p in self.passes.items() if k == kind and width >= blocks]
        padded = min(fitting, key=lambda p: p.fields["table"], default=None)
        return padded if padded is not None and padded.size_for(count) is not None else None

    def _padded_pass(self, batch: Batch) -> PaddedPass | None:
        if not self.passes or not batch.decode:
            return None
        query_len = len(batch.chunks[0].token_ids)
        kind = "decode" if query_len == 1 else "verify" if query_len == self.k + 1 else ""
        return self._pass_for(kind, len(batch.chunks), max(len(c.blocks) for c in batch.chunks))

    def _decode_context(self, inputs, query_len: int, draft_block: int = 0) -> ForwardContext:
        replay = inputs["replay"][:, 0] if "replay" in inputs else None
        slot, start, ids = inputs["slot"][:, 0], inputs["start"][:, 0], inputs["ids"]
        if "chained" in inputs:
            start = torch.where(inputs["chained"][:, 0] > 0, self.slots.length[slot], start)
        known = self.slots.last[slot, None]
        if ids.shape[1] > 1:
            known = torch.cat((known, self.slots.drafts[slot]), dim=1)[:, :ids.shape[1]]
        ids = torch.where(ids < 0, known, ids)
        return ForwardContext.for_decode(ids.reshape(-1), start, slot, inputs["table"], query_len,
                                         replay_start=replay, draft_block=draft_block,
                                         write_draft_cache=bool(self.k) and not draft_block)

    def _target_pass(self, query_len: int):
        def target(inputs):
            return {"logits": self.model(self._decode_context(inputs, query_len), self.caches)}
        return target

    def _draft_pass(self, inputs):
        ctx = self._decode_context(inputs, self.k, draft_block=self.k)
        sampling = DraftSampling(as_float(inputs["temperature"][:, 0]), as_float(inputs["top_p"][:, 0]),
                                 inputs["top_k"][:, 0], inputs["seed"][:, 0], self.confidence_temperature,
                                 self.filter_order)
        proposal = self.model.draft(ctx, self.caches, sampling)
        self.slots.drafts.index_copy_(0, inputs["slot"][:, 0], proposal.tokens)
        return {"tokens": proposal.tokens, "logprobs": proposal.logprobs, "confidences": proposal.confidences}

    def _sequence_arrays(self, chunks, width: int) -> dict[str, np.ndarray]:
        return self._sequence_arrays_of([c.token_ids for c in chunks], [c.start for c in chunks],
                                        [c.slot for c in chunks], [c.blocks for c in chunks],
                                        [c.request for c in chunks], width, [c.chained for c in chunks])

    def _sequence_arrays_of(self, tokens, starts, slots, blocks, requests, width: int,
                            chained: Sequence[bool] = ()) -> dict[str, np.ndarray]:
        table = np.zeros((len(requests), width), dtype=np.int64)
        for row, owned in enumerate(blocks):
            table[row, :len(owned)] = owned
        arrays = {"ids": np.asarray(tokens, dtype=np.int64), "start": starts, "slot": slots, "table": table}
        if self.k:
            arrays["chained"] = np.asarray(chained if len(chained) else [False] * len(requests), dtype=np.int64)
        if self.replay is not None:
            arrays["replay"] = self._replay_starts(requests)
        return arrays

    def _replay_starts(self, requests) -> list[int]:
        return [max(0, (r.replay_length or len(r.prompt_token_ids)) - self.replay.keep_tokens) for r in requests]

    def _context(self, batch: Batch) -> ForwardContext:
        chunks = batch.chunks
        if any(c.chained or PLACEHOLDER in c.drafts for c in chunks):
            raise RuntimeError("a step whose inputs wait on the device (chained starts, drafts still there) "
                               "must run as a decode-shaped pass; this batch is not one")
        rows, offset = [], 0
        for c in chunks:
            offset += len(c.token_ids)
            if c.samples:
                rows.extend(range(offset - len(c.drafts) - 1, offset))
        requests = [c.request for c in chunks]
        starts = self._replay_starts(requests) if self.replay is not None else None
        compact = starts is not None and self.replay.mode == "compact" and self.context is None  # mask: same values
        ctx = ForwardContext.for_sequences(
            [c.token_ids for c in chunks], [c.start for c in chunks], [c.slot for c in chunks],
            [list(c.blocks) for c in chunks], decode=batch.decode, logits_rows=rows, replay_starts=starts,
            replay_compact=compact, device=self.runtime.device, upload=self.runtime.upload)
        ctx.write_draft_cache = bool(self.k)
        if min((min(c.token_ids) for c in chunks if c.token_ids), default=0) < 0:
            ctx.input_ids = torch.where(ctx.input_ids < 0, self.slots.last[ctx.slot_of_token], ctx.input_ids)
        if self.context is not None:
            ctx = shard_context(ctx, self.context.rank, self.context.world, self.context.context, self.runtime.upload)
        return ctx

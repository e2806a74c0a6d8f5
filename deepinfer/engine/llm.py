"""The offline engine: ``LLM(...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import concurrent.futures
import contextlib
import random
import time
import weakref
from typing import Sequence

import torch
from tqdm.auto import tqdm

from deepinfer.config.schema import ConfigError
from deepinfer.decoding.dspark import DSpark
from deepinfer.decoding.sampler import emit
from deepinfer.decoding.grammar_service import GrammarService
from deepinfer.decoding.step_masks import step_masks
from deepinfer.engine.device import make_runtime
from deepinfer.engine.graphs import graph_batch_sizes
from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.kv_sizing import plan_kv_blocks
from deepinfer.engine.output_processor import OutputProcessor, request_output
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Batch, Scheduler
from deepinfer.engine.scheduler_deepinfer import DeepInferScheduler
from deepinfer.engine.step import LaunchedStep, StepStats
from deepinfer.hal.registry import OpTable
from deepinfer.models.registry import build_model, resolve_checkpoint
from deepinfer.parallel.data import agree, gather_in_order, placeholder_pass
from deepinfer.parallel.expert import ExpertBalancing, shard_experts
from deepinfer.parallel.groups import check_plan, join, lost_peer
from deepinfer.tokenizer import IncrementalDecoder, load_tokenizer

Prompt = str | Sequence[int]
RETRY_SEED_STEP = 0x9E3779B97F4A7C15
"""Added to a request's seed (mod 2**64) for each retry of a structured output."""


class LLM:
    """Offline generation with continuous batching over a paged KV cache.

    ``LLM(model="tiny", backend="reference", overrides=["decoding=greedy", ...])`` composes the
    same Hydra configs as ``python -m deepinfer``; :meth:`from_config` takes a composed config."""

    def __init__(self, model: str = "tiny", backend: str = "reference", overrides: Sequence[str] = ()):
        from deepinfer.config.compose import compose

        self._setup(compose([f"model={model}", f"backend={backend}", *overrides]))

    @classmethod
    def from_config(cls, app) -> "LLM":
        llm = cls.__new__(cls)
        llm._setup(app)
        return llm

    def _setup(self, app) -> None:
        _refuse_unfinished_features(app)
        self.config = app
        engine, decoding = app.engine, app.decoding
        self.ops = OpTable(app.backend.name, app.backend.fallback, dict(app.backend.overrides),
                           batch_invariant=engine.batch_invariant, options=app.backend.op_options)
        self.groups = join(app.parallel, torch.device(app.backend.device))  # first: it picks this rank's GPU
        self.runtime = make_runtime(torch.device(app.backend.device))
        before = self.runtime.allocated()
        self.model, self.random_weights = build_model(app.model, self.ops, self.runtime.device, engine.seed)
        if self.groups is not None and getattr(self.model.cfg, "engram_layer_ids", None):
            raise ConfigError(f"parallel={app.parallel.name} with Engram layers {self.model.cfg.engram_layer_ids} is "
                              f"not supported yet: the Engram tables' distributed storage belongs to the parallelism "
                              f"work; run Engram models on one process (parallel=single)")
        maps = []
        if self.groups is not None and self.groups.expert is not None:
            maps = shard_experts(self.model, self.groups.expert, app.parallel.num_extra_experts,
                                 app.parallel.eplb_window)
        self.balancing = ExpertBalancing(maps, app.parallel.eplb_interval)
        self._lockstep = self.groups is not None and self.groups.data is not None and self.groups.expert is not None
        weight_bytes = self.runtime.allocated() - before
        cfg = self.model.cfg
        if engine.bounded_replay.mode != "off":
            self.model.check_bounded_replay(engine.bounded_replay.keep_tokens)
        self.max_model_len = self.model.max_model_len
        self.tokenizer = load_tokenizer(resolve_checkpoint(app.model.checkpoint), cfg.vocab_size,
                                        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
        graphs = engine.cuda_graphs if engine.cuda_graphs is not None else self.runtime.supports_graphs
        if graphs and self.groups is not None and self.groups.expert is not None:
            if engine.cuda_graphs:
                raise ConfigError(f"engine.cuda_graphs=true with parallel={app.parallel.name}: the expert-parallel "
                                  f"dispatch sizes its exchange on the host, which a CUDA graph cannot replay; "
                                  f"leave engine.cuda_graphs unset (off under expert parallelism)")
            graphs = False
        padded = graphs or self.runtime.supports_graphs
        graphs = graphs and self.runtime.supports_graphs
        num_blocks = plan_kv_blocks(self.model, self.ops, self.runtime, engine, decoding.num_draft_tokens, graphs,
                                    weight_bytes)
        kv = KVManager(num_blocks, engine.max_num_seqs + 1, self.model.page_tokens)
        self._draft_after_decode_only = engine.scheduler == "deepinfer"  # its first decode verifies padding
        if engine.scheduler == "deepinfer":
            need = engine.max_num_seqs * (1 + decoding.num_draft_tokens)
            if engine.max_num_batched_tokens < need:
                raise ConfigError(f"engine.scheduler=deepinfer runs every decoding request in one step: "
                                  f"engine.max_num_batched_tokens={engine.max_num_batched_tokens} must be at least "
                                  f"max_num_seqs x (1 + num_draft_tokens) = {need}")
            self.scheduler = DeepInferScheduler(kv, engine.max_num_seqs, engine.max_num_batched_tokens,
                                                engine.prefill_chunk_tokens, engine.batch_invariant, stop=self._finish)
        else:
            self.scheduler = Scheduler(kv, engine.max_num_seqs, engine.max_num_batched_tokens,
                                       engine.prefill_chunk_tokens, whole_verify=engine.batch_invariant)
        self.runner = ModelRunner(self.model, self.runtime, num_blocks, engine.max_num_seqs + 1, engine.max_num_seqs,
                                  num_draft_tokens=decoding.num_draft_tokens,
                                  confidence_temperature=decoding.confidence_temperature_per_step,
                                  bounded_replay=engine.bounded_replay, padded_decode=padded,
                                  filter_order=decoding.filter_order,
                                  context=self.groups if self.groups is not None and self.groups.context else None)
        self.dspark = None
        if decoding.num_draft_tokens:
            max_rows = engine.max_num_seqs * (decoding.num_draft_tokens + 1)
            self.dspark = DSpark(self.model, self.runner, decoding.num_draft_tokens, decoding.varlen,
                                 decoding.confidence_temperature_per_step,
                                 max_rows=max_rows, verify_cost=decoding.verify_cost,
                                 buckets=graph_batch_sizes(max_rows))
        if graphs:
            bar = tqdm(total=self.runner.num_graphs, desc="capture CUDA graphs", disable=not engine.use_tqdm,
                       dynamic_ncols=True)
            self.runner.capture_graphs(lambda: bar.update(1))
            bar.close()
        self.outputs = OutputProcessor(self.tokenizer.eos_token_ids, self.max_model_len, self._finish, self._retry)
        self.async_scheduling = engine.async_scheduling if engine.async_scheduling is not None \
            else self.runtime.overlaps_host
        self._inflight: LaunchedStep | None = None
        self._seeds = random.Random(engine.seed)
        self._params_seeds: dict[int, int] = {}
        self._next_id = 0
        self.grammars: GrammarService | None = None
        self._awaiting_grammar: list[Request] = []

    def _unseeded(self, params: SamplingParams) -> int:
        """A seed for a request whose ``params`` give none: its own (``engine.seed_scope=request``)
        or the one every request of this ``params`` object shares (``sampling_params``)."""
        if self.config.engine.seed_scope == "request":
            return self._seeds.getrandbits(64)
        key = id(params)
        if key not in self._params_seeds:
            self._params_seeds[key] = self._seeds.getrandbits(64)
            weakref.finalize(params, self._params_seeds.pop, key, None)
        return self._params_seeds[key]

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the input order.

        Every prompt and parameter set is checked before anything runs: a bad one raises a
        ValueError naming it, and no request (here or already queued) is affected. Under attention
        data parallelism (torchrun, ``parallel.data_parallel`` ranks) every rank is called with
        the same prompts, runs every ``world``-th of them (each with the seed and request id it
        would get in one process) and returns all the outputs."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = self._params_for(len(prompts), sampling_params)
        data = self.groups.data if self.groups is not None else None
        owned = range(len(prompts)) if data is None else range(self.groups.rank, len(prompts), self.groups.world)
        requests = [self._make_request(i, p, sp, grammar=i in owned)
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        requests = [requests[i] for i in owned]
        for request in requests:
            self._enqueue(request)
        show = self.config.engine.use_tqdm if use_tqdm is None else use_tqdm
        try:
            self._run_until_done(requests, show)
            outputs = [request_output(r) for r in requests]
            if data is None:
                return outputs
            return gather_in_order(outputs, len(prompts), self.groups.rank, self.groups.world, data)
        except RuntimeError as error:
            failure = lost_peer(error, self.groups, self.config.parallel)
            if failure is None:
                raise
            raise failure from error

    def chat(self, conversations: list[dict] | Sequence[list[dict]], sampling_params=None,
             use_tqdm: bool | None = None, thinking: bool = True) -> list[RequestOutput]:
        """Generate replies to OpenAI-style message lists, rendered with the model's chat template
        (official V4/V4.1 checkpoints, through deepseek-recipe; other models raise a clear error)."""
        from deepinfer.tokenizer import render_chat

        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        model_type = self.model.cfg.to_hf_dict()["model_type"]
        prompts = [render_chat(list(c), model_type, self.tokenizer, thinking=thinking) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Request:
        """Queue one request (validated first); :meth:`step` advances every queued request."""
        request = self._make_request(0, prompt, params or SamplingParams.from_decoding(self.config.decoding))
        self._enqueue(request)
        return request

    def step(self) -> "StepStats":
        """One engine step: admit requests whose grammar compiled, schedule, launch the model, the
        sampling (grammar masks applied, drafts verified) and the draft pass for the next step,
        then collect the emitted tokens and drafts. With asynchronous scheduling a decode or
        verify step stays in flight: the next call schedules and launches the step after it
        first (its input tokens, drafts and start positions filled in on the device) and only
        then collects it. With nothing to run it waits for the first grammar to compile. Returns
        what the step did and what finished."""
        stats = StepStats(self._admit_compiled_grammars())
        previous, self._inflight = self._inflight, None
        if self.balancing.advance():  # EPLB re-places the experts: the step in flight reads them
            if previous is not None:
                self._collect(previous, stats)
                previous = None
            self.balancing.rebalance()
        if not self.scheduler.has_work:
            if previous is not None:
                self._collect(previous, stats)
            elif self._awaiting_grammar:
                concurrent.futures.wait([r.grammar.future for r in self._awaiting_grammar], timeout=1.0,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return stats
        if self.dspark:
            self.dspark.assign_verify_drafts(self.scheduler.running)
        started = time.perf_counter()
        self._inflight = self._launch(self.scheduler.schedule(), stats)
        if previous is not None:
            self._collect(previous, stats)
        if not self._can_overlap(self._inflight):
            current, self._inflight = self._inflight, None
            self._collect(current, stats)
            verified = self.dspark is not None and any(c.drafts for c in current.batch.chunks)
            if previous is None and verified and current.batch.decode:
                self.dspark.observe(current.batch.num_tokens, time.perf_counter() - started)
        return stats

    def _launch(self, batch: Batch, stats: "StepStats") -> "LaunchedStep":
        """Queue the forward and sampling of ``batch``, and with DSpark the draft pass after it.
        Fed tokens count as computed at launch (the drafts it verifies once it is collected);
        each sampling chunk's next token becomes a placeholder until the step is collected."""
        stats.count_launch(batch)
        sampling = [c for c in batch.chunks if c.samples]
        drafting = [c for c in sampling if self.dspark is not None and self.dspark.drafts_after(c)
                    and not (self._draft_after_decode_only and c.start < len(c.request.prompt_token_ids))]
        for chunk in batch.chunks:
            chunk.request.num_computed += len(chunk.token_ids) - len(chunk.drafts)
        for chunk in sampling:
            chunk.request.inflight += 1
            chunk.request.unconfirmed += len(chunk.drafts)
        for chunk in drafting:
            chunk.request.pending_drafts += self.dspark.k
        masks = step_masks(sampling, self.model.vocab_size, self.outputs.eos_token_ids)

        def device_work():
            emissions = emit(self.ops, self.runtime, sampling, self.runner.run(batch), masks, self.runner.slots,
                             self.config.decoding.filter_order)
            if drafting:
                return emissions, self.dspark.launch(drafting)
            if self.dspark is not None and self._lockstep:  # the peers' draft passes exchange rows with this rank
                placeholder_pass(self.model.mtp)
            return emissions, None
        return LaunchedStep(batch, sampling, self.runtime.run_async(device_work))

    def _collect(self, step: "LaunchedStep", stats: "StepStats") -> None:
        """Wait for ``step``'s results, advance its requests, free what finished, take the drafts."""
        pending, drafted = step.pending()
        emissions = pending.collect()
        for chunk in step.sampling:
            chunk.request.unconfirmed -= len(chunk.drafts)
        stats.count_emissions(emissions)
        errors = [error for emission in emissions for error in emission.calibration_errors]
        if errors:  # the batch's calibration, as DeepInfer's sampler reports it, on every request verified
            batch_error = sum(errors) / len(errors)
            for chunk, emission in zip(step.sampling, emissions):
                if emission.calibration_errors:
                    chunk.request.batch_calibration_errors.append(batch_error)
        stats.finished += self.outputs.apply(step.sampling, emissions)
        for request in step.release_after:
            self.scheduler.kv.release(request)
        if self.dspark:
            self.dspark.receive([c.request for c in step.sampling], drafted)

    def _can_overlap(self, step: "LaunchedStep") -> bool:
        """Whether the step after ``step`` may be scheduled before ``step`` is collected: a
        decode step without grammars that holds every running request, after which the next
        schedule can never preempt (which would discard a request in flight). With DSpark (fixed
        verify lengths, decode-shaped passes) every request must have been drafted for, and its
        next step must verify all ``k`` drafts and draft again whatever this one accepts, so that
        both steps are the ones the synchronous engine would run."""
        running = self.scheduler.running
        if not (self.async_scheduling and step.batch.decode and len(step.batch.chunks) == len(running)
                and all(c.request.grammar is None and not _masks_tokens(c.request) for c in step.sampling)):
            return False
        if self.dspark is None:
            return not any(c.drafts for c in step.sampling) and len(self.scheduler.kv.free_blocks) >= len(running)
        k, kv = self.dspark.k, self.scheduler.kv
        worst = [r.num_computed + r.unconfirmed + 1 + k for r in running]
        new_blocks = sum(max(0, kv.blocks_for(n) - len(r.blocks)) for r, n in zip(running, worst))
        return (not self.dspark.varlen and bool(self.runner.passes)
                and len(running) * (k + 1) <= self.scheduler.token_budget
                and all(r.pending_drafts == k and self.dspark.room(r, r.unconfirmed) >= k for r in running)
                and max(worst) + k <= self.max_model_len and new_blocks <= len(kv.free_blocks))

    def _finish(self, request: Request, reason: str) -> None:
        """Stop ``request``; its cache is freed once no launched step writes there."""
        launched = self._inflight
        keep = launched is not None and any(c.request is request for c in launched.batch.chunks)
        self.scheduler.finish(request, reason, release=not keep)
        if keep:
            launched.release_after.append(request)

    def _retry(self, request: Request) -> bool:
        """Run a structured request whose output broke its schema again from its prompt, with
        another seed, while ``engine.structured.retries`` allows; False when it does not."""
        if request.num_retries >= self.config.engine.structured.retries or request.inflight:
            return False
        request.num_retries += 1
        request.seed = (request.seed + RETRY_SEED_STEP) % (1 << 64)
        request.output_token_ids, request.output_logprobs, request.text = [], [], ""
        request.detokenizer = IncrementalDecoder(self.tokenizer)
        request.draft_logprobs, request.draft_confidences = None, []
        request.grammar.matcher.reset()
        self.scheduler.restart(request)
        return True

    def abort(self, request_id: int) -> bool:
        """Stop a queued or running request: it finishes with reason "abort" and keeps the tokens
        it emitted; its blocks and state slot return to the free lists (once the step in flight,
        if it writes there, is collected). False when no unfinished request has that id."""
        scheduler = self.scheduler
        for request in [*scheduler.running, *scheduler.waiting, *self._awaiting_grammar]:
            if request.request_id != request_id or request.finished:
                continue
            if request in scheduler.running:
                self._finish(request, "abort")
            else:
                if request in scheduler.waiting:
                    scheduler.waiting.remove(request)
                else:
                    self._awaiting_grammar.remove(request)
                request.status, request.finish_reason = Status.FINISHED, "abort"
                scheduler.kv.release(request)
            request.text += request.detokenizer.finish() if request.detokenizer is not None else ""
            return True
        return False

    def drain(self) -> list[Request]:
        """Collect the step in flight, if any; returns the requests that finished."""
        stats = StepStats()
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._collect(step, stats)
        return stats.finished

    def _enqueue(self, request: Request) -> None:
        """To the scheduler, or, while its grammar compiles, to the grammar waiting list."""
        if request.grammar is not None:
            self._awaiting_grammar.append(request)
        else:
            self.scheduler.add(request)

    def _admit_compiled_grammars(self) -> list[Request]:
        """Schedule the waiting requests whose matcher is ready; fail those whose grammar did not
        compile (or not in time). Returns the failed ones."""
        failed, waiting = [], []
        if self.groups is not None and self.groups.shared_schedule and self._awaiting_grammar:
            # admission waits on no rank's compile speed
            concurrent.futures.wait([r.grammar.future for r in self._awaiting_grammar])
        for request in self._awaiting_grammar:
            if not self.grammars.poll(request.grammar):
                waiting.append(request)
            elif request.grammar.error is not None:
                request.status, request.finish_reason, request.error = Status.FINISHED, "error", request.grammar.error
                failed.append(request)
            else:
                self.scheduler.add(request)
        self._awaiting_grammar = waiting
        return failed

    def _grammar_service(self) -> GrammarService:
        if self.grammars is None:
            structured = self.config.engine.structured
            self.grammars = GrammarService(self.tokenizer, self.model.vocab_size, structured.compile_timeout_s,
                                           structured.compile_workers, structured.any_whitespace,
                                           structured.backend)
        return self.grammars

    def _params_for(self, count, sampling_params):
        if sampling_params is None:
            return [SamplingParams.from_decoding(self.config.decoding)] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
        return params

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams, grammar: bool = True) -> Request:
        """A validated request (its id and seed drawn); ``grammar``: start compiling its structured
        output's grammar (off for a data-parallel peer's request, drawn only to keep ids and seeds
        in step)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {index}: sampling params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt, add_bos=True) if text is not None else list(prompt)
        vocab = self.model.vocab_size
        if not ids or (text is not None and not text):
            raise ValueError(f"request {index}: the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {index}: prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {index}: the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}; shorten it or raise model.max_model_len")
        for name in ("banned_token_ids", "golden_token_ids"):
            out_of_vocab = [t for t in getattr(params, name) or () if t >= vocab]
            if out_of_vocab:
                raise ValueError(f"request {index}: {name} holds {out_of_vocab[0]}, outside the vocabulary "
                                 f"[0, {vocab})")
        seed = params.seed if params.seed is not None else self._unseeded(params)
        request = Request(self._next_id, text, ids, params, seed, force_topk=self.config.decoding.force_topk)
        request.detokenizer = IncrementalDecoder(self.tokenizer)
        if params.structured is not None and grammar:
            request.grammar = self._grammar_service().request(params.structured)
        self._next_id += 1
        return request

    def _run_until_done(self, requests: list[Request], show: bool) -> None:
        """Step until ``requests`` finish; on KeyboardInterrupt (or any error) abort the unfinished
        ones and collect the step in flight, so that every block and state slot is free again,
        then re-raise."""
        try:
            self._step_until_done(requests, show)
        except BaseException:
            for request in requests:
                if not request.finished:
                    self.abort(request.request_id)
            with contextlib.suppress(Exception):  # the error being raised is the one to report
                self.drain()
            raise

    def _step_until_done(self, requests: list[Request], show: bool) -> None:
        bar = tqdm(total=len(requests), desc="generate", disable=not show, dynamic_ncols=True)
        started, prefilled = time.perf_counter(), 0
        produced = sum(len(r.output_token_ids) for r in requests)
        while True:
            unfinished = not all(r.finished for r in requests)
            if self._lockstep:  # DP with EP: every forward's MoE exchanges need every rank
                forward = self.scheduler.has_work
                unfinished, someone_forwards = agree(unfinished, forward, self.groups.data)
                if not forward and someone_forwards:
                    if self.balancing.advance():  # the step count and load window stay in step
                        self.balancing.rebalance()
                    placeholder_pass(self.model.layers)
                    if self.dspark is not None:
                        placeholder_pass(self.model.mtp)
                    continue
            if not unfinished:
                break
            stats = self.step()
            prefilled += stats.num_prefill_tokens
            elapsed = max(time.perf_counter() - started, 1e-9)
            out = sum(len(r.output_token_ids) for r in requests) - produced
            status = f"in {prefilled / elapsed:.0f} tok/s, out {out / elapsed:.0f} tok/s"
            if self.dspark:
                steps = sum(r.num_verify_steps for r in requests)
                accepted = sum(r.num_accepted for r in requests)
                errors = [e for r in requests for e in r.calibration_errors]
                status += (f", drafted {sum(r.num_drafted for r in requests)}, accepted {accepted} "
                           f"({accepted / max(steps, 1):.2f}/step), calibration err "
                           f"{sum(errors) / max(len(errors), 1):.2f}")
            bar.set_postfix_str(status)
            bar.update(sum(r in requests for r in stats.finished))
        self.drain()
        bar.close()


def _masks_tokens(request: Request) -> bool:
    """Whether ``request``'s next step masks tokens (bans, ``min_tokens``, teacher forcing): its
    masks are built from its collected outputs, so the step before it must have been collected."""
    params = request.params
    return bool(params.banned_token_ids) or params.golden_token_ids is not None or \
        len(request.output_token_ids) < params.min_tokens


def _is_token_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, int) for t in value)


def _refuse_unfinished_features(app) -> None:
    """Switches whose features have not landed yet fail loudly instead of being ignored."""
    if app.engine.batch_invariant and app.decoding.num_draft_tokens and app.decoding.varlen:
        raise ValueError("engine.batch_invariant=true needs a fixed verify length with DSpark: confidence-scheduled "
                         "verification picks lengths from the whole batch; set decoding.varlen=false")
    if app.engine.batch_invariant and app.engine.max_num_batched_tokens < app.decoding.num_draft_tokens + 1:
        raise ValueError(f"engine.batch_invariant=true verifies all {app.decoding.num_draft_tokens} drafts of a request "
                         f"in one step: engine.max_num_batched_tokens must be >= {app.decoding.num_draft_tokens + 1}")
    check_plan(app.parallel, app.decoding)

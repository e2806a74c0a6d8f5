"""The offline engine: ``LLM(...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import concurrent.futures
import math
import random
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from deepinfer.engine.kv_manager import KVManager
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.runner import ModelRunner
from deepinfer.decoding.dspark import DSpark
from deepinfer.decoding.sampler import Emission, emit
from deepinfer.decoding.structured import GrammarService, step_bitmasks
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Batch, Scheduler
from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS
from deepinfer.models.deepseek_v41.bounded_replay import check_keep_tokens
from deepinfer.models.registry import build_model, resolve_checkpoint
from deepinfer.tokenizer import IncrementalDecoder, load_tokenizer

Prompt = str | Sequence[int]


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
        self.ops = OpTable(app.backend.name, app.backend.fallback, dict(app.backend.overrides),
                           batch_invariant=app.engine.batch_invariant)
        device = torch.device(app.backend.device)
        self.model, self.random_weights = build_model(app.model, self.ops, device, app.engine.seed)
        cfg = self.model.cfg
        if app.engine.bounded_replay.mode != "off":
            check_keep_tokens(app.engine.bounded_replay.keep_tokens, cfg)
        self.max_model_len = app.model.max_model_len
        self.tokenizer = load_tokenizer(resolve_checkpoint(app.model.checkpoint), cfg.vocab_size,
                                        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
        per_seq = math.ceil(self.max_model_len / PAGE_TOKENS)
        num_blocks = app.engine.num_kv_blocks or 1 + app.engine.max_num_seqs * per_seq
        if num_blocks - 1 < per_seq:
            raise ValueError(f"engine.num_kv_blocks={num_blocks} cannot hold one sequence of max_model_len "
                             f"{self.max_model_len} ({per_seq} blocks of {PAGE_TOKENS} plus the padding block)")
        kv = KVManager(num_blocks, app.engine.max_num_seqs + 1)
        self.scheduler = Scheduler(kv, app.engine.max_num_seqs, app.engine.max_num_batched_tokens,
                                   app.engine.prefill_chunk_tokens, whole_verify=app.engine.batch_invariant)
        decoding = app.decoding
        self.runner = ModelRunner(self.model, self.ops, num_blocks, app.engine.max_num_seqs + 1, device,
                                  write_draft_cache=decoding.num_draft_tokens > 0,
                                  bounded_replay=app.engine.bounded_replay)
        self.dspark = None
        if decoding.num_draft_tokens:
            self.dspark = DSpark(self.model, self.runner.caches, self.ops, decoding.num_draft_tokens, decoding.varlen,
                                 decoding.confidence_temperature, self.max_model_len,
                                 max_rows=app.engine.max_num_seqs * (decoding.num_draft_tokens + 1))
        self._seeds = random.Random(app.engine.seed)
        self._next_id = 0
        self.grammars: GrammarService | None = None
        self._awaiting_grammar: list[Request] = []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs keep the input order.

        Every prompt and parameter set is checked before anything runs: a bad one raises a
        ValueError naming it, and no request (here or already queued) is affected."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = self._params_for(len(prompts), sampling_params)
        requests = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        for request in requests:
            self._enqueue(request)
        show = self.config.engine.use_tqdm if use_tqdm is None else use_tqdm
        self._run_until_done(requests, show)
        return [_output(r) for r in requests]

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

    def step(self) -> list[Request]:
        """One engine step: admit requests whose grammar compiled, schedule, run the model, emit
        tokens (grammar masks applied, drafts verified), then draft for the next step. With
        nothing to run it waits for the first grammar to compile. Returns the requests that
        finished."""
        finished = self._admit_compiled_grammars()
        if not self.scheduler.has_work:
            self._last_batch = Batch([])
            if self._awaiting_grammar:
                deadline = min(r.grammar.deadline for r in self._awaiting_grammar)
                concurrent.futures.wait([r.grammar.future for r in self._awaiting_grammar],
                                        timeout=max(0.0, deadline - time.monotonic()),
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return finished
        if self.dspark:
            self.dspark.assign_verify_drafts(self.scheduler.running)
        batch = self.scheduler.schedule()
        sampling = [c for c in batch.chunks if c.samples]
        masks = step_bitmasks(sampling, self.model.cfg.vocab_size)
        finished += self._postprocess(batch, emit(self.ops, sampling, self.runner.run(batch), masks))
        if self.dspark:
            self.dspark.propose([c.request for c in sampling if not c.request.finished])
        self._last_batch = batch
        return finished

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
            self.grammars = GrammarService(self.tokenizer, self.model.cfg.vocab_size, structured.compile_timeout_s,
                                           structured.compile_threads, structured.any_whitespace)
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

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {index}: sampling params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt, add_bos=True) if text is not None else list(prompt)
        vocab = self.model.cfg.vocab_size
        if not ids or (text is not None and not text):
            raise ValueError(f"request {index}: the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {index}: prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {index}: the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}; shorten it or raise model.max_model_len")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        request = Request(self._next_id, text, ids, params, seed)
        request.detokenizer = IncrementalDecoder(self.tokenizer)
        if params.structured is not None:
            request.grammar = self._grammar_service().request(params.structured)
        self._next_id += 1
        return request

    def _run_until_done(self, requests: list[Request], show: bool) -> None:
        bar = tqdm(total=len(requests), desc="generate", disable=not show, dynamic_ncols=True)
        started, prefilled = time.perf_counter(), 0
        produced = sum(len(r.output_token_ids) for r in requests)
        while not all(r.finished for r in requests):
            finished = self.step()
            batch = self._last_batch
            prefilled += sum(len(c.token_ids) for c in batch.chunks if c.start < len(c.request.prompt_token_ids))
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
            bar.update(sum(r in requests for r in finished))
        bar.close()

    def _postprocess(self, batch: Batch, emissions: list[Emission]) -> list[Request]:
        """Advance each request: KV stays valid for its pending tokens and accepted drafts; emitted
        tokens are appended one by one until a stop condition."""
        finished, emitted = [], iter(emissions)
        for chunk in batch.chunks:
            request = chunk.request
            if not chunk.samples:
                request.num_computed += len(chunk.token_ids)
                continue
            emission = next(emitted)
            request.num_computed += len(chunk.token_ids) - len(chunk.drafts) + emission.accepted
            if emission.drafted:
                request.num_drafted += emission.drafted
                request.num_accepted += emission.accepted
                request.num_verify_steps += 1
                request.verify_log.append((emission.drafted, emission.accepted))
                request.calibration_errors += emission.calibration_errors
            for token, logprobs in zip(emission.tokens, emission.logprobs):
                request.output_token_ids.append(token)
                if logprobs is not None:
                    request.output_logprobs.append(logprobs)
                grammar_end = self._grammar_reason(request, token)
                reason = grammar_end or self._stop_reason(request, token)
                if reason:
                    if reason == "length" or grammar_end:
                        request.text += request.detokenizer.finish()
                    self.scheduler.finish(request, reason)
                    finished.append(request)
                    break
        return finished

    def _grammar_reason(self, request: Request, token: int) -> str | None:
        """Advance a constrained request's matcher: "stop" once the grammar has ended (its stop
        token accepted, whatever ``ignore_eos`` says), "error" if it refuses ``token``."""
        if request.grammar is None:
            return None
        matcher = request.grammar.matcher
        if not matcher.accept_token(token):
            request.error = (f"structured output: the grammar refused emitted token {token} (its mask was not "
                             f"applied to that row); the request stopped there")
            return "error"
        return "stop" if matcher.is_terminated() else None

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token in self.tokenizer.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        request.text += request.detokenizer.push(token)
        if params.stop:
            window = request.text[-(max(map(len, params.stop)) + 16):]
            hits = [window.find(s) for s in params.stop if s in window]
            if hits:
                cut = len(request.text) - len(window) + min(hits)
                request.text = request.text[:cut]
                return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None


def _is_token_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, int) for t in value)


def _output(request: Request) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
        text=request.text, token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
        logprobs=request.output_logprobs if request.params.logprobs is not None else None,
        num_drafted=request.num_drafted, num_accepted=request.num_accepted, verify_log=list(request.verify_log),
        error=request.error,
        metrics={
            "preemptions": request.num_preemptions,
            "verify_steps": request.num_verify_steps,
            "mean_accepted_length": request.num_accepted / request.num_verify_steps if request.num_verify_steps else 0.0,
            "calibration_error": (sum(request.calibration_errors) / len(request.calibration_errors)
                                  if request.calibration_errors else 0.0),
        },
    )


def _refuse_unfinished_features(app) -> None:
    """Switches whose features have not landed yet fail loudly instead of being ignored."""
    if app.engine.async_scheduling:
        raise ValueError("engine.async_scheduling=true is not implemented yet; set it to false")
    if app.engine.batch_invariant and app.decoding.num_draft_tokens and app.decoding.varlen:
        raise ValueError("engine.batch_invariant=true needs a fixed verify length with DSpark: confidence-scheduled "
                         "verification picks lengths from the whole batch; set decoding.varlen=false")
    if app.engine.batch_invariant and app.engine.max_num_batched_tokens < app.decoding.num_draft_tokens + 1:
        raise ValueError(f"engine.batch_invariant=true verifies all {app.decoding.num_draft_tokens} drafts of a request "
                         f"in one step: engine.max_num_batched_tokens must be >= {app.decoding.num_draft_tokens + 1}")
    parallel = app.parallel
    if (parallel.data_parallel, parallel.expert_parallel, parallel.context_parallel) != (1, 1, 1):
        raise ValueError("attention DP, expert parallelism and context parallelism are not implemented yet; "
                         "use parallel=single")


def run_app(app) -> int:
    """The ``python -m deepinfer`` generate task: read prompts, generate, print the results."""
    if app.task != "generate":
        raise ValueError(f"task={app.task!r} is not implemented yet; only task=generate exists")
    prompts = _read_prompts(app)
    llm = LLM.from_config(app)
    if llm.random_weights:
        print(f"NOTE: model {app.model.name!r} has random weights (no model.checkpoint), so the generated "
              f"text is noise; model=tiny is the trained default.")
    outputs = llm.generate(prompts)
    lines = []
    for out in outputs:
        lines.append(f"--- prompt {out.request_id}: {out.prompt!r}\n{out.text}\n[{len(out.token_ids)} tokens, "
                     f"finish: {out.finish_reason}]")
    print("\n".join(lines))
    if app.output_file:
        import json
        from pathlib import Path

        Path(app.output_file).write_text(json.dumps([out.__dict__ for out in outputs], indent=2))
    return 0


def _read_prompts(app) -> list[str]:
    if app.prompts_file:
        from pathlib import Path

        prompts = [line for line in Path(app.prompts_file).read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompts_file={app.prompts_file!r} holds no prompts (one per line)")
        return prompts
    if app.prompt:
        return [app.prompt]
    raise ValueError('give prompt="..." or prompts_file=path (one prompt per line)')

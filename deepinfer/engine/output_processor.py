"""After each step: append emitted tokens, detokenise, and stop requests that are done."""
from __future__ import annotations

from typing import Callable

from deepinfer.decoding.sampler import Emission
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.request import Request


class OutputProcessor:
    """Advances each request by what its step emitted. A request stops on an end-of-sequence
    token (unless ``ignore_eos``), one of its ``stop_token_ids`` or ``stop`` strings (the text
    is cut before the string), its grammar ending or refusing a token, ``max_tokens`` or
    ``max_model_len``. A constrained request that would stop with output its grammar or JSON
    schema rejects (cut short, or breaking a keyword the grammar cannot enforce) ends "error"
    instead, its ``error`` saying why, unless ``retry(request)`` runs it again (True).
    ``finish(request, reason)`` releases a stopped request."""

    def __init__(self, eos_token_ids, max_model_len: int, finish: Callable[[Request, str], None],
                 retry: Callable[[Request], bool] = lambda request: False):
        self.eos_token_ids, self.max_model_len, self.finish = set(eos_token_ids), max_model_len, finish
        self.retry = retry

    def apply(self, chunks, emissions: list[Emission]) -> list[Request]:
        """The emissions of a step's sampling ``chunks``: a request's cache also holds the drafts
        it accepted; emitted tokens replace its placeholder and are appended one by one until a
        stop condition. A request that finished while the step ran drops its emission. Returns
        the requests that finished."""
        finished = []
        for chunk, emission in zip(chunks, emissions):
            request = chunk.request
            request.inflight -= 1
            if request.finished:
                continue
            request.num_computed += emission.accepted
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
                    if reason == "stop" and request.grammar is not None:
                        violation = request.grammar.violation(request.text)
                        if violation is not None and self.retry(request):
                            break
                        if violation is not None:
                            request.error, reason = violation, "error"
                    self.finish(request, reason)
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
            failure = getattr(matcher, "error", None)
            request.error = (f"structured output: the grammar library stopped matching: {failure}" if failure else
                             f"structured output: the grammar refused emitted token {token} (its mask was not "
                             f"applied to that row); the request stopped there")
            return "error"
        return "stop" if matcher.is_terminated() else None

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        request.text += request.detokenizer.push(token)
        if params.stop:
            window = request.text[-(max(map(len, params.stop)) + 16):]
            hits = [window.find(s) for s in params.stop if s in window]
            if hits:
                cut = len(request.text) - len(window) + min(hits)
                request.text = request.text[:cut]
                return "stop"
        produced = len(request.output_token_ids)
        if produced >= params.max_tokens or len(request.prompt_token_ids) + produced >= self.max_model_len:
            return "length"
        if params.golden_token_ids is not None and produced >= len(params.golden_token_ids):
            return "length"
        return None


def request_output(request: Request) -> RequestOutput:
    """The user-facing result of a request."""
    output = RequestOutput(
        request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
        text=request.text, token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
        logprobs=request.output_logprobs if request.params.logprobs is not None else None,
        num_drafted=request.num_drafted, num_accepted=request.num_accepted, verify_log=list(request.verify_log),
        error=request.error,
        metrics={
            "preemptions": request.num_preemptions,
            "verify_steps": request.num_verify_steps,
            "clipped_drafts": request.num_clipped_drafts,
            "mean_accepted_length": request.num_accepted / request.num_verify_steps if request.num_verify_steps else 0.0,
            "calibration_error": (sum(request.calibration_errors) / len(request.calibration_errors)
                                  if request.calibration_errors else 0.0),
            "batch_calibration_error": (sum(request.batch_calibration_errors) / len(request.batch_calibration_errors)
                                        if request.batch_calibration_errors else 0.0),
        },
    )
    if request.verify_log:
        depth = max(verified for verified, _ in request.verify_log)
        output.metrics["verified_by_draft"] = [sum(v > j for v, _ in request.verify_log) for j in range(depth)]
        output.metrics["accepted_by_draft"] = [sum(a > j for _, a in request.verify_log) for j in range(depth)]
    if request.grammar is not None:
        output.metrics["structured_backend"] = request.grammar.backend
    if request.grammar is not None and request.grammar.spec["type"] == "json":
        output.metrics["structured_validation_only"] = list(request.grammar.validation_only)
        output.metrics["structured_retries"] = request.num_retries
    return output

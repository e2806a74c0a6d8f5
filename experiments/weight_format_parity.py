"""Backend parity of a model with quantized weights (``model.weight_format``), on one GPU.

For each weight format the composed model (``model=small``, the study's default) is built once
(seeded random weights, held as the format says) and run by two backends over the same tokens:
``study.expected_backend`` (the reference) and the composed ``backend`` (sm100, on its device). A
prefill of ``study.batch`` prompts, then ``study.steps`` decode steps fed the expected backend's
greedy tokens, so both see the same inputs at every step. Per step it reports the relative L2
error of the composed backend's logits against the expected ones, the largest absolute error and
the share of rows whose argmax agrees, and writes
``experiments/results/weight_format_parity_<tag>.csv``. The composed backend runs with its own
``backend.fallback`` (none by default), so an op it lacks fails the run.
``model.expert_activation_format=fp8`` (which asks for ``model.weight_format`` set too) casts the
experts' activations of the quantized formats' models.

    python experiments/weight_format_parity.py [study.formats=[none,fp8,mxfp4]] [study.batch=4]
        [study.prompt_len=96] [study.steps=8] [study.tag=h200] [overrides...]
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer.hal.registry import OpTable
from deepinfer.models.deepseek_v41.config import PAGE_TOKENS
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.moe import cast_expert_activations
from deepinfer.models.deepseek_v41.weights import hold_quantized, init_random_weights
from deepinfer.models.forward_context import ForwardContext
from deepinfer.models.registry import build_config
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The weight formats and the tokens both backends run."""

    FAST = ("model=tiny_random", "backend=reference", "study.batch=2", "study.prompt_len=16", "study.steps=2")

    tag: Optional[str] = "h200"
    """Suffix of the result files' names (for example the card: ``h200``)."""
    formats: list[str] = field(default_factory=lambda: ["none", "fp8", "mxfp4"])
    """Weight formats, each a model: ``none`` (weights in ``model.dtype``), ``fp8``, ``mxfp4``."""
    expected_backend: str = "reference"
    """The backend whose logits and greedy tokens are the expectation."""
    batch: int = 4
    """Prompts run together."""
    prompt_len: int = 96
    """Tokens of each (random) prompt."""
    steps: int = 8
    """Decode steps after the prefill."""


class SwitchedOps:
    """An op table whose backend can be swapped after the model holds it."""

    def __init__(self, tables: dict[str, OpTable]):
        self.tables, self.current = tables, next(iter(tables))

    def __getattr__(self, name):
        return getattr(self.tables[self.current], name)


def run_backend(model, ops: SwitchedOps, backend: str, prompts: list[list[int]], steps: int,
                feed: list[list[int]] | None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits of the prefill and each decode step on ``backend``; decode feeds ``feed`` (default
    this backend's own greedy tokens)."""
    ops.current = backend
    device = model.embed.weight.device
    length = len(prompts[0]) + steps + 1
    blocks = math.ceil(length / PAGE_TOKENS)
    caches = model.allocate_caches(1 + len(prompts) * blocks, len(prompts) + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(prompts))]
    slots = list(range(1, len(prompts) + 1))
    logits, tokens = [], []
    with torch.no_grad():
        ctx = ForwardContext.for_sequences(prompts, [0] * len(prompts), slots, tables, device=device)
        logits.append(model(ctx, caches).float())
        for step in range(steps):
            chosen = feed[step] if feed else logits[-1].argmax(-1).tolist()
            tokens.append(chosen)
            starts = [len(prompts[0]) + step] * len(prompts)
            ctx = ForwardContext.for_sequences([[t] for t in chosen], starts, slots, tables, decode=True,
                                               device=device)
            logits.append(model(ctx, caches).float())
    return logits, tokens


def compare(want: torch.Tensor, got: torch.Tensor) -> dict:
    """Relative L2 error, largest absolute error and argmax agreement of ``got`` against ``want``."""
    return {"rel_l2": ((got - want).norm() / want.norm()).item(), "max_abs": (got - want).abs().max().item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def format_rows(app, settings: Settings, config, ops: SwitchedOps, fmt: str, prompts: list[list[int]]) -> list[dict]:
    """The rows of one weight format (a model of architecture ``config`` built in it): the
    prefill's and each decode step's comparison."""
    started = time.time()
    model = DeepseekV41ForCausalLM(config, ops, dtype=app.model.torch_dtype,
                                   max_model_len=settings.prompt_len + settings.steps + 64)
    model = hold_quantized(init_random_weights(model, 0), None if fmt == "none" else fmt)
    activations = app.model.expert_activation_format if fmt != "none" else None
    model = cast_expert_activations(model, activations).to(app.backend.device)
    built = time.time() - started
    want, fed = run_backend(model, ops, settings.expected_backend, prompts, settings.steps, None)
    got, _ = run_backend(model, ops, app.backend.name, prompts, settings.steps, fed)
    rows = []
    for step, (w, g) in enumerate(zip(want, got)):
        row = {"model": app.model.name, "weight_format": fmt, "expert_activations": activations or app.model.dtype,
               "step": "prefill" if step == 0 else step,
               **{k: round(v, 6) for k, v in compare(w, g).items()}}
        rows.append(row)
        print(f"{fmt:>6} {row['step']!s:>8} rel_l2 {row['rel_l2']:.2e} max_abs {row['max_abs']:.3e} "
              f"argmax agree {row['argmax_agree']:.3f}", flush=True)
    print(f"{fmt}: model built in {built:.0f} s", flush=True)
    return rows


def main(argv=None) -> int:
    app, settings = compose_study("weight_format_parity", Settings, argv)
    config = build_config({"arch": app.model.arch, "config": app.model.config})
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size - 1, (settings.batch, settings.prompt_len), generator=gen).tolist()
    backend = app.backend
    ops = SwitchedOps({settings.expected_backend: OpTable(settings.expected_backend),
                       backend.name: OpTable(backend.name, backend.fallback, dict(backend.overrides),
                                             options=backend.op_options)})
    rows = []
    for fmt in settings.formats:
        rows += format_rows(app, settings, config, ops, fmt, prompts)
        torch.cuda.empty_cache()
    path = write_results(settings.results_path("weight_format_parity"), rows,
                         study_command("weight_format_parity", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

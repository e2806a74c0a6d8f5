"""SWA bounded replay: prefill time and consumer-layer FLOPs vs prompt length, off vs compact.

Each prompt is prefilled alone through the engine (``experiment=bounded_replay``: chunks of
``engine.prefill_chunk_tokens``, one sampled token). Consumer-layer FLOPs are counted from the
rows each consumer layer computes (checked against the rows a hook sees); the divergence columns
report (not judge) how far ``compact`` moves the sampled row's logits from ``off``.

    python experiments/bounded_replay.py [study.lengths=[1024,2048,...]] [study.threads=N] [study.tag=cpu]
        [overrides...]

Writes experiments/results/bounded_replay_<tag>.csv and a PNG beside it.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v41.config import ATTENTION_DIM, INDEX_HEAD_DIM
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command

MODES = ("off", "compact")


@dataclass
class Settings(StudySettings):
    """The prompt lengths swept and the CPU threads."""

    FAST = ("study.lengths=[512,1024]", "study.threads=1")
    PLOTS = True

    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    """Prompt lengths, each prefilled alone in both modes."""
    threads: Optional[int] = None
    """Torch CPU threads; None: torch's default."""
    tag: Optional[str] = "cpu"
    """Suffix of the result files' names (for example the card: ``h200``)."""


def query_chunks(length: int, chunk: int, keep: int | None) -> list[tuple[int, int]]:
    """``(consumer query rows, chunk end)`` per prefill chunk; ``keep`` None is mode off."""
    first_kept = 0 if keep is None else max(0, length - keep)
    out = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        out.append((end - max(start, first_kept) if end > first_kept else 1, end))
    return out


def consumer_flops(cfg, chunks: list[tuple[int, int]], length: int) -> float:
    """FLOPs (2 per multiply-add) of the YOCO consumer layers: projections, MoE, mHC and sparse
    attention (window + index_topk keys) on the query rows, indexer logits against every
    compressed key of the chunk's context, and the compressed KV / index K store on all tokens."""
    hidden, lora, heads, dim = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, ATTENTION_DIM
    mixes = cfg.hc_mult * (2 + cfg.hc_mult)
    routed = cfg.num_experts_per_tok * 3 * hidden * cfg.moe_intermediate_size
    per_row = 2 * (hidden * lora + lora * heads * dim + hidden * dim + heads * dim * cfg.o_lora_rank
                   + cfg.o_groups * cfg.o_lora_rank * hidden + hidden * cfg.n_routed_experts + routed
                   + 3 * hidden * cfg.shared_width + 2 * mixes * cfg.hc_mult * hidden)
    total = 0.0
    for ratio in cfg.layer_ratios[cfg.n_prefill_layers:]:
        keys = cfg.sliding_window + (cfg.index_topk if ratio else 0)
        layer_row = per_row + 4 * heads * dim * keys
        if ratio:
            layer_row += 2 * (lora * cfg.index_n_heads * INDEX_HEAD_DIM + hidden * cfg.index_n_heads)
            total += sum(rows * 2 * cfg.index_n_heads * INDEX_HEAD_DIM * (end // ratio) for rows, end in chunks)
            total += length * 2 * hidden * dim * (2 if ratio > 1 else 1) + (length // ratio) * 2 * dim * INDEX_HEAD_DIM
        total += layer_row * sum(rows for rows, _ in chunks)
    return total


def prefill(llm: LLM, prompt: list[int]) -> tuple[float, int, torch.Tensor]:
    """Seconds to prefill ``prompt`` and sample one token, consumer query rows seen, last logits."""
    seen, logits = [0], []
    first_consumer = llm.model.layers[llm.model.cfg.n_prefill_layers].attn
    hooks = [first_consumer.register_forward_pre_hook(lambda _, args: seen.__setitem__(0, seen[0] + args[0].shape[0])),
             llm.model.register_forward_hook(lambda _, __, out: logits.append(out))]
    try:
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - started, seen[0], logits[-1][-1]
    finally:
        for hook in hooks:
            hook.remove()


def engines(app) -> dict[str, LLM]:
    """One engine per bounded-replay mode, otherwise as ``app`` describes."""
    engine = app.engine
    return {mode: LLM.from_config(dataclasses.replace(app, engine=dataclasses.replace(
        engine, bounded_replay=dataclasses.replace(engine.bounded_replay, mode=mode)))) for mode in MODES}


def measure(llms: dict[str, LLM], length: int, keep: int, chunk: int) -> dict:
    """The result row of one prompt length: time, consumer rows and FLOPs per mode, and the
    sampled row's logit divergence."""
    cfg = llms["compact"].model.cfg
    prompt = [random.Random(length).randrange(3, cfg.vocab_size) for _ in range(length)]
    result = {}
    for mode, llm in llms.items():
        seconds, seen, logits = prefill(llm, prompt)
        chunks = query_chunks(length, chunk, keep if mode == "compact" else None)
        expected = sum(r for r, _ in chunks)
        if seen != expected:
            raise RuntimeError(f"{mode} at {length} tokens: the first consumer layer computed {seen} rows, "
                               f"the analytic count is {expected}")
        result[mode] = (seconds, seen, consumer_flops(cfg, chunks, length), logits)
    off_s, off_rows, off_flops, off_logits = result["off"]
    cmp_s, cmp_rows, cmp_flops, cmp_logits = result["compact"]
    return {
        "prompt_tokens": length, "keep_tokens": keep, "chunk_tokens": chunk,
        "off_prefill_s": off_s, "compact_prefill_s": cmp_s, "time_ratio": off_s / cmp_s,
        "off_consumer_rows": off_rows, "compact_consumer_rows": cmp_rows,
        "off_consumer_gflops": off_flops / 1e9, "compact_consumer_gflops": cmp_flops / 1e9,
        "flops_ratio": off_flops / cmp_flops,
        "max_abs_logit_diff": float((off_logits - cmp_logits).abs().max()),
        "same_next_token": int(off_logits.argmax()) == int(cmp_logits.argmax()),
    }


def main(argv=None) -> int:
    app, settings = compose_study("bounded_replay", Settings, argv)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    llms = engines(app)
    keep, chunk = app.engine.bounded_replay.keep_tokens, min(app.engine.prefill_chunk_tokens,
                                                             app.engine.max_num_batched_tokens)
    for llm in llms.values():
        prefill(llm, list(range(3, 3 + 2 * keep)))
    rows, path = [], settings.results_path("bounded_replay")
    for length in settings.lengths:
        rows.append(measure(llms, length, keep, chunk))
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
        write_results(path, rows, study_command("bounded_replay", argv))  # a cut-short sweep keeps its rows
    plot(rows, path, f"model={app.model.name}, {settings.tag}")
    return 0


def plot(rows, path, title: str) -> None:
    """Prefill time and consumer-layer GFLOPs against prompt length, both modes, beside ``path``."""
    plt = pyplot()
    if plt is None:
        return
    lengths = [r["prompt_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        left.plot(lengths, [r[f"{mode}_prefill_s"] for r in rows], marker="o", label=mode)
        right.plot(lengths, [r[f"{mode}_consumer_gflops"] for r in rows], marker="o", label=mode)
    for ax, label in ((left, "prefill time (s)"), (right, "consumer-layer GFLOPs")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"SWA bounded replay, keep_tokens={rows[0]['keep_tokens']} ({title})")
    fig.tight_layout()
    print(f"wrote {save_figure(fig, path.with_suffix('.png'))}")


if __name__ == "__main__":
    sys.exit(main())

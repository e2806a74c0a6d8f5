"""SWA bounded replay: prefill time and consumer-layer FLOPs vs prompt length, off vs compact.

Each prompt is prefilled alone through the engine (``experiment=bounded_replay``: chunks of
``engine.prefill_chunk_tokens``, one sampled token). Consumer-layer FLOPs are counted from the
rows each consumer layer computes (checked against the rows a hook sees); the divergence columns
report (not judge) how far ``compact`` moves the sampled row's logits from ``off``.

    python experiments/bounded_replay.py [--lengths 1024,2048,...] [--tag cpu] [hydra overrides...]

Writes experiments/results/bounded_replay_<tag>.csv and a PNG beside it.
"""
from __future__ import annotations

import argparse
import csv
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config.compose import compose
from deepinfer.models.deepseek_v41.config import ATTENTION_DIM, INDEX_HEAD_DIM

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("off", "compact")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tag", default="cpu")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    base = ["experiment=bounded_replay", *overrides]
    llms = {mode: LLM.from_config(compose(base + [f"engine.bounded_replay.mode={mode}"])) for mode in MODES}
    app, cfg = llms["compact"].config, llms["compact"].model.cfg
    keep, chunk = app.engine.bounded_replay.keep_tokens, min(app.engine.prefill_chunk_tokens,
                                                             app.engine.max_num_batched_tokens)
    for llm in llms.values():
        prefill(llm, list(range(3, 3 + 2 * keep)))
    rows, path = [], RESULTS / f"bounded_replay_{args.tag}.csv"
    for length in lengths:
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
        rows.append({
            "prompt_tokens": length, "keep_tokens": keep, "chunk_tokens": chunk,
            "off_prefill_s": off_s, "compact_prefill_s": cmp_s, "time_ratio": off_s / cmp_s,
            "off_consumer_rows": off_rows, "compact_consumer_rows": cmp_rows,
            "off_consumer_gflops": off_flops / 1e9, "compact_consumer_gflops": cmp_flops / 1e9,
            "flops_ratio": off_flops / cmp_flops,
            "max_abs_logit_diff": float((off_logits - cmp_logits).abs().max()),
            "same_next_token": int(off_logits.argmax()) == int(cmp_logits.argmax()),
        })
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
        write_csv(rows, path, args.threads)  # after every length, so a cut-short sweep keeps its rows
    plot(rows, path.with_suffix(".png"), f"model={app.model.name}, {args.tag}")


def write_csv(rows, path: Path, threads: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with path.open("w", newline="") as f:
        card = f" {torch.cuda.get_device_name()}," if torch.cuda.is_available() else ""
        f.write(f"# {stamp}; {platform.node()} {platform.machine()} {threads} threads,{card} torch {torch.__version__}; "
                f"command: python experiments/bounded_replay.py {' '.join(sys.argv[1:])}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'deepinfer[experiments]'): no plot")
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
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

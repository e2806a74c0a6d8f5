"""``python -m deepinfer task=bench bench.batch=16 bench.prompt_tokens=512``: one engine point
(batch size, prompt and output lengths, the configured decoding policy), measured end to end and
appended to ``bench.csv`` in ``output_dir`` (default ``outputs/bench``), with the plots of every
point there so far redrawn into ``bench.png``: prefill throughput against the time to the last
first token, and decode throughput against tokens per second per user (DeepInfer's two views).
A sweep is a Hydra multirun, e.g. ``python -m deepinfer -m experiment=engine_sweep`` or
``python -m deepinfer -m task=bench bench.batch=1,8,64 decoding=greedy,dspark``."""
from __future__ import annotations

import csv
import random
import shlex
import statistics
import time
from pathlib import Path

from deepinfer.results import command_line, pyplot, write_results


def run_bench(app) -> dict:
    """Measure one point of ``app`` (its ``bench`` settings); returns the row it appended."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    bench = app.bench
    llm = LLM.from_config(app)
    vocab = llm.model.vocab_size
    params = SamplingParams.from_decoding(app.decoding)
    params.max_tokens, params.ignore_eos = bench.output_tokens, True
    llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    rng = random.Random(bench.seed)
    requests = [llm.add_request([rng.randrange(3, vocab) for _ in range(bench.prompt_tokens)], params)
                for _ in range(bench.batch)]
    started, first_token_at, step_times = time.perf_counter(), None, []
    while not all(r.finished for r in requests):
        step_start = time.perf_counter()
        llm.step()
        now = time.perf_counter()
        if first_token_at is None and all(r.output_token_ids for r in requests):
            first_token_at = now
        elif first_token_at is not None:
            step_times.append(now - step_start)
    llm.drain()
    ended = time.perf_counter()
    first_token_at = first_token_at or ended
    emitted = sum(len(r.output_token_ids) for r in requests)
    decode_s = max(ended - first_token_at, 1e-9)
    verify_steps = sum(r.num_verify_steps for r in requests)
    row = {"model": app.model.name, "backend": app.backend.name, "decoding": app.decoding.name,
           "draft_tokens": app.decoding.num_draft_tokens, "batch": bench.batch,
           "prompt_tokens": bench.prompt_tokens, "output_tokens": bench.output_tokens,
           "prefill_s": round(first_token_at - started, 6),
           "prefill_tok_s": round(bench.batch * bench.prompt_tokens / max(first_token_at - started, 1e-9), 3),
           "decode_s": round(decode_s, 6), "decode_tok_s": round((emitted - bench.batch) / decode_s, 3),
           "tok_s_per_user": round((emitted - bench.batch) / decode_s / bench.batch, 3),
           "step_ms_median": round(1000 * statistics.median(step_times), 3) if step_times else 0.0,
           "accepted_per_step": round(sum(r.num_accepted for r in requests) / verify_steps, 3) if verify_steps else 0.0}
    out = Path(app.output_dir or "outputs/bench")
    path = write_results(out / "bench.csv", [row], job_command(), append=True)
    print("  ".join(f"{key} {value}" for key, value in row.items()))
    print(f"wrote {path}")
    figure = plot(path, out / "bench.png")
    if figure is not None:
        print(f"wrote {figure}")
    return row


def job_command() -> str:
    """This point's command: under Hydra (one job of a multirun, too) its own overrides, so the
    row reruns that point alone; else this process's command line."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except ValueError:  # not run through Hydra's main (a call from Python)
        return command_line("deepinfer")
    return " ".join(["python -m deepinfer", *(shlex.quote(o) for o in overrides)])


def plot(path: Path, figure: Path) -> Path | None:
    """Prefill tok/s against the time to the last first token, and decode tok/s against tok/s per
    user, one line per decoding policy and prompt length; None where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    rows = list(csv.DictReader(path.open()))
    fig, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["backend"], r["decoding"], r["prompt_tokens"]) for r in rows})
    for backend, decoding, prompt in series:
        points = sorted((r for r in rows if (r["backend"], r["decoding"], r["prompt_tokens"]) == (backend, decoding, prompt)),
                        key=lambda r: int(r["batch"]))
        label = f"{backend} {decoding} prompt {prompt}"
        prefill.plot([1000 * float(r["prefill_s"]) for r in points], [float(r["prefill_tok_s"]) for r in points],
                     marker="o", label=label)
        decode.plot([float(r["tok_s_per_user"]) for r in points], [float(r["decode_tok_s"]) for r in points],
                    marker="o", label=label)
        for r in points:
            decode.annotate(r["batch"], (float(r["tok_s_per_user"]), float(r["decode_tok_s"])), fontsize=7)
    prefill.set(xlabel="time to the last first token (ms)", ylabel="prefill tok/s", title="prefill")
    decode.set(xlabel="tok/s per user", ylabel="decode tok/s", title="decode (points: batch size)")
    for ax in (prefill, decode):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    return figure

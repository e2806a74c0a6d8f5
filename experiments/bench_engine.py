"""The engine end to end on one GPU: prefill and decode throughput against the HF peer, the
measured ceilings and the floor, all in one run.

Rows (``kind``):

* ``engine``: ``LLM`` (Hydra-composed: ``model``, each ``--backends`` entry, the overrides) per
  prompt length, batch size and DSpark off/on. Greedy requests of random tokens are prefilled
  (``prefill_tok_s``: prompt tokens over the prefill steps' wall time), then ``--steps`` decode
  steps are timed one by one (``step_ms``: median; ``decode_tok_s``: emitted tokens over the
  decode steps' wall time; ``tok_s_per_user``: that over the batch).
* ``hf``: transformers' ``DeepseekV3ForCausalLM`` with the widths of ``--hf-widths`` (random
  weights, bf16, eager PyTorch with SDPA attention, its own KV cache), same prompts and steps.
* ``ceiling``: device copy bandwidth (GB/s, a large device-to-device copy), and the dense bf16
  matmul and FP8 e4m3 ``torch._scaled_mm`` rates (TFLOP/s, 8192-cubed).
* ``floor``: per engine point of the first backend, the bytes a decode step must read (non-expert weights, the
  experts a batch routes to in expectation with uniform routing, the LM head, and each
  sequence's attended KV) over the measured copy bandwidth.

``--dspark-model`` (the trained ``tiny``) adds rows with drafts off and on, to read the
wall-clock speedup of DSpark; ``--compare-async`` adds the first backend's rows with
asynchronous scheduling off (engines run with it on, the GPU default); ``--trace-prefill``
prints the heaviest kernels of one traced prefill, ``--trace-decode`` the kernels of a few eager
decode steps by HAL op. Prints a table, writes
``experiments/results/bench_engine_<tag>.csv`` after every row (``--append`` keeps an earlier
run's rows, each with its own stamp) and the Pareto-style plot (decode tok/s against tok/s per
user) beside it.

    python experiments/bench_engine.py --tag h200 [--backends sm100 reference] [--batches 1 4 16 64 128]
        [--prompts 512 4096] [--steps 32] [--hf] [--dspark-model tiny] [--compare-async] [--append]
        [--trace-prefill B] [--trace-decode B] [overrides...]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_ops import ceilings, write_csv
from op_profile import host_syncs, idle_gaps, is_op_range, labelled_ops, op_table, op_times
from deepinfer import LLM, SamplingParams

RESULTS = Path(__file__).parent / "results"
HF_WIDTHS = dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64,
                 num_key_value_heads=64, q_lora_rank=1280, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=6,
                 moe_intermediate_size=2048, intermediate_size=2048, n_shared_experts=1, n_group=1, topk_group=1,
                 first_k_dense_replace=0)
"""The HF peer: ``model=small``'s attention and MoE widths in DeepSeek-V3's layout."""
STAMP = ("card", "date", "commit", "torch", "command")


def engine_rows(backend: str, model: str, prompts: list[int], batches: list[int], steps: int, dspark: bool,
                overrides: list[str], bandwidth: float, record, profile: tuple[int, ...] = (),
                memory_share: float = 0.45, asynchronous: bool = True, trace_prefill: int = 0,
                trace_decode: int = 0, floors: bool = True) -> None:
    """One engine's points, each passed to ``record`` as it is measured (then the floor rows, with
    ``floors``). Engines run one after another in this process, each taking ``memory_share`` of
    the card (``engine.gpu_memory_utilization``). Each point runs once untimed first, so no kernel
    compiles while it is timed. ``trace_prefill``: a batch size whose prefill at
    the first prompt length is traced once more, after the timed points, its heaviest kernels
    printed; ``trace_decode``: a batch size whose decode steps are traced eagerly by op."""
    longest = max(prompts) + steps * 8 + 64
    decoding = ["decoding=dspark", "decoding.varlen=false"] if dspark else ["decoding=greedy"]
    if backend == "reference":
        overrides = [*overrides, "backend.device=cuda"]
    llm = LLM(model, backend, ["engine.use_tqdm=false", f"engine.max_num_seqs={max(batches)}",
                               f"model.max_model_len={longest}", f"engine.max_num_batched_tokens={max(8192, max(prompts))}",
                               f"engine.prefill_chunk_tokens={max(prompts)}",
                               f"engine.gpu_memory_utilization={memory_share}",
                               f"engine.async_scheduling={str(asynchronous).lower()}", *decoding, *overrides])
    rows = []
    for prompt in prompts:
        for batch in batches:
            _point(llm, prompt, batch, 4)  # untimed: the kernels of this point's shapes compile here
            row = _point(llm, prompt, batch, steps, profile=batch in profile and prompt == prompts[0])
            row.update(kind="engine", backend=backend, model=model, dspark=dspark, prompt=prompt, batch=batch,
                       asynchronous=asynchronous)
            rows.append(row)
            record(row)
    if trace_prefill:
        print(prefill_kernels(llm, prompts[0], trace_prefill), flush=True)
    if trace_decode:
        print(decode_kernels(llm, prompts[0], trace_decode), flush=True)
    for row in floor_rows(llm, rows, bandwidth) if floors else []:
        record(row)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _point(llm: LLM, prompt: int, batch: int, steps: int, profile: bool = False) -> dict:
    budget = llm.config.engine.max_num_batched_tokens
    params = SamplingParams(temperature=0, max_tokens=(steps + 2) * (1 + (llm.dspark.k if llm.dspark else 0))
                            + math.ceil(batch * prompt / budget), ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in _prompts(llm, prompt, batch)]
    prefill_s, decode_times, emitted, decoding = 0.0, [], 0, False
    tracing = None
    while not all(r.finished for r in requests):
        before = sum(len(r.output_token_ids) for r in requests)
        started = time.perf_counter()
        stats = llm.step()
        elapsed = time.perf_counter() - started
        if stats.num_prefill_tokens:
            prefill_s += elapsed
        elif not decoding:
            decoding = stats.decode  # the first decode step collects the prefill's tokens (or none, in flight)
        elif stats.decode and stats.num_seqs == batch and len(decode_times) < steps:
            decode_times.append(elapsed)
            emitted += sum(len(r.output_token_ids) for r in requests) - before
            if profile and len(decode_times) == steps // 2:
                tracing = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                tracing.__enter__()
            elif tracing is not None and len(decode_times) == steps // 2 + 8:
                torch.cuda.synchronize()
                tracing.__exit__(None, None, None)
                profile, tracing = False, _gpu_busy(tracing)
    decode_s = sum(decode_times)
    row = dict(prefill_tok_s=round(batch * prompt / prefill_s), step_ms=round(1e3 * statistics.median(decode_times), 3),
               decode_tok_s=round(emitted / decode_s, 1), tok_s_per_user=round(emitted / decode_s / batch, 2),
               accepted_per_step=round(emitted / len(decode_times) / batch - 1, 3))
    if isinstance(tracing, dict):
        row.update(tracing)
    return row


def prefill_kernels(llm: LLM, prompt: int, batch: int, top: int = 25) -> str:
    """The prefill of ``batch`` fresh ``prompt``-token requests under the profiler: GPU-busy
    share, kernel count, where the GPU waits (:func:`op_profile.idle_gaps`) and the host waits for
    it (:func:`op_profile.host_syncs`), the GPU time of each HAL op (:mod:`op_profile`) and the ``top``
    kernels by total GPU time."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in _prompts(llm, prompt, batch)]
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with labelled_ops(llm.ops), torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        while not all(r.finished for r in requests):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    busy = _gpu_busy(prof, steps=1)
    totals: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not is_op_range(e):
            entry = totals.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.end - e.time_range.start
            entry[1] += 1
    gpu_us = sum(t for t, _ in totals.values())
    lines = [f"prefill trace, {batch} x {prompt} tokens: wall {1e3 * wall:.1f} ms (traced, ops labelled), kernels "
             f"{busy['gpu_kernels_per_step']:.0f}, GPU idle {busy['gpu_idle_pct']} %, "
             f"kernel time {gpu_us / 1e3:.1f} ms", idle_gaps(prof), host_syncs(prof), "by op:", op_table(op_times(prof)), "by kernel:"]
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms {100 * us / gpu_us:5.1f} % x{count:<5d} {name[:110]}")
    return "\n".join(lines)


def decode_kernels(llm: LLM, prompt: int, batch: int, steps: int = 4) -> str:
    """``steps`` decode steps of ``batch`` ``prompt``-token requests run eagerly (the captured
    graphs set aside, so every HAL op call is labelled) under the profiler: kernels per step, and
    per op its GPU time and kernel count over the steps. A graph replays the same kernels."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in _prompts(llm, prompt, batch)]
    while llm.step().num_prefill_tokens:
        pass
    llm.step()
    passes, llm.runner.passes = llm.runner.passes, {}
    try:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with labelled_ops(llm.ops), torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                llm.step()
            torch.cuda.synchronize()
    finally:
        llm.runner.passes = passes
    while not all(r.finished for r in requests):
        llm.step()
    busy = _gpu_busy(prof, steps=steps)
    return "\n".join([f"decode trace, batch {batch}, {steps} eager steps: kernels {busy['gpu_kernels_per_step']:.0f} "
                      f"a step", "by op (all steps):", op_table(op_times(prof), top=60)])


def _gpu_busy(prof, steps: int = 8) -> dict:
    """GPU-busy share of the traced steps: the union of kernel (and copy) intervals over the span
    from the first to the last one (``gpu_idle_pct``: all idle time, also the gaps between the
    kernels of one step), the idle time between consecutive steps (``gpu_idle_between_steps_pct``:
    from the end of a step's copy to the host to the start of the next device work), and kernels
    per step."""
    spans = sorted((e.time_range.start, e.time_range.end, "DtoH" in e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not is_op_range(e))
    busy, between, end, after_copy = 0.0, 0.0, -math.inf, None
    for lo, hi, copy_down in spans:
        if after_copy is not None and lo >= after_copy:
            between += lo - after_copy
            after_copy = None
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
        if copy_down:
            after_copy = hi
    total = spans[-1][1] - spans[0][0]
    return dict(gpu_idle_pct=round(100 * (1 - busy / total), 2),
                gpu_idle_between_steps_pct=round(100 * between / total, 2),
                gpu_kernels_per_step=round(len(spans) / steps, 1))


def _prompts(llm: LLM, length: int, batch: int) -> list[list[int]]:
    """Random token ids for random weights; for a trained checkpoint, its held-out text (so
    drafts have something to predict), each request from its own offset."""
    rng = random.Random(length * 1000 + batch)
    if llm.random_weights:
        return [[rng.randrange(3, llm.model.vocab_size - 1) for _ in range(length)] for _ in range(batch)]
    from dspark_acceptance import heldout_prompts

    text = llm.tokenizer.encode(" ".join(heldout_prompts(llm, 64)), add_bos=False)
    text = text * math.ceil(2 * length / len(text))
    return [text[(i * 37) % (len(text) - length):][:length] for i in range(batch)]


def floor_rows(llm: LLM, rows: list[dict], bandwidth: float) -> list[dict]:
    """The bytes-over-``bandwidth`` floor of each engine decode point."""
    model, cfg = llm.model, llm.model.cfg
    expert, other = 0, 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.startswith("mtp.") or name.startswith("embed."):
            continue
        if ".experts." in name and ".shared_experts." not in name:
            expert += size
        else:
            other += size
    per_expert = expert / (cfg.n_routed_experts * cfg.num_hidden_layers)
    kv_per_token = model.cache_bytes(1, 0) / model.page_tokens
    out = []
    for row in rows:
        batch, context = row["batch"], row["prompt"]
        touched = cfg.n_routed_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)
        attended = min(context, cfg.index_topk + cfg.sliding_window)
        step_bytes = other + touched * per_expert * cfg.num_hidden_layers + batch * attended * kv_per_token
        seconds = step_bytes / bandwidth
        out.append(dict(kind="floor", backend="floor", model=row["model"], dspark=row["dspark"], prompt=context,
                        batch=batch, step_ms=round(1e3 * seconds, 4), decode_tok_s=round(batch / seconds, 1),
                        tok_s_per_user=round(1 / seconds, 2), step_bytes=int(step_bytes)))
    return out


def hf_rows(prompts: list[int], batches: list[int], steps: int, max_kv_gib: float, record) -> None:
    """The transformers DeepseekV3 peer: prefill, then greedy decode with its own cache."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**HF_WIDTHS, max_position_embeddings=max(prompts) + steps + 16,
                              attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(config).eval()
    torch.set_default_dtype(default)
    per_token = 2 * HF_WIDTHS["num_hidden_layers"] * HF_WIDTHS["num_attention_heads"] * \
        (HF_WIDTHS["qk_nope_head_dim"] + HF_WIDTHS["qk_rope_head_dim"] + HF_WIDTHS["v_head_dim"])
    with torch.no_grad():
        model(torch.randint(3, 1000, (1, 16), device="cuda"))
        for prompt in prompts:
            for batch in batches:
                if batch * (prompt + steps) * per_token > max_kv_gib * (1 << 30) or batch * prompt > 65536:
                    continue
                ids = torch.randint(3, HF_WIDTHS["vocab_size"] - 1, (batch, prompt), device="cuda")
                torch.cuda.synchronize()
                started = time.perf_counter()
                out = model(ids, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                prefill = time.perf_counter() - started
                cache, times = out.past_key_values, []
                for _ in range(steps):
                    started = time.perf_counter()
                    out = model(token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    token.tolist()
                    times.append(time.perf_counter() - started)
                    cache = out.past_key_values
                row = dict(kind="hf", backend="hf_deepseek_v3", model="small_widths", dspark=False, prompt=prompt,
                           batch=batch, prefill_tok_s=round(batch * prompt / prefill),
                           step_ms=round(1e3 * statistics.median(times), 3),
                           decode_tok_s=round(batch * steps / sum(times), 1),
                           tok_s_per_user=round(steps / sum(times), 2))
                record(row)
                del out, cache
                torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


def _line(row: dict) -> str:
    def num(key, fmt):
        return format(row[key], fmt) if isinstance(row.get(key), (int, float)) else "-"
    return (f"{row['kind']:<8} {row['backend']:<15} {row['model']:<12} dspark={str(row.get('dspark', '')):<5} "
            f"async={str(row.get('asynchronous', '')):<5} "
            f"prompt {row.get('prompt', 0):>5} batch {row.get('batch', 0):>4}  prefill {num('prefill_tok_s', '>9')} tok/s  "
            f"step {num('step_ms', '>8.3f')} ms  decode {num('decode_tok_s', '>9.1f')} tok/s  "
            f"per user {num('tok_s_per_user', '>7.1f')}  GPU idle {num('gpu_idle_pct', '>5.1f')} % "
            f"(between steps {num('gpu_idle_between_steps_pct', '>5.1f')} %)")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = sorted({r["prompt"] for r in rows if r.get("prompt")})
    fig, axes = plt.subplots(1, max(len(prompts), 1), figsize=(6 * max(len(prompts), 1), 5), squeeze=False)
    for ax, prompt in zip(axes[0], prompts):
        series: dict[str, list] = {}
        for r in rows:
            if r.get("prompt") == prompt and r["kind"] in ("engine", "hf", "floor"):
                label = f"{r['backend']} {r['model']}" + (" dspark" if r.get("dspark") else "") + \
                    (" sync" if r.get("asynchronous") is False else "")
                series.setdefault(label, []).append((r["tok_s_per_user"], r["decode_tok_s"], r["batch"]))
        for label, points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-" if "floor" not in label else "k--",
                    label=label)
            for x, y, b in points:
                ax.annotate(str(b), (x, y), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tok/s per user")
        ax.set_ylabel("decode tok/s (all users)")
        ax.set_title(f"decode, {prompt}-token prompts (labels: batch)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--model", default="small")
    parser.add_argument("--backends", nargs="*", default=["sm100", "reference"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--reference-batches", type=int, nargs="+", default=[1, 16, 64],
                        help="batch sizes of the reference backend (it is slow)")
    parser.add_argument("--reference-prompts", type=int, nargs="+", default=[512])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dspark", action="store_true", help="also every engine point with DSpark on")
    parser.add_argument("--dspark-model", default="", help="e.g. tiny: DSpark off/on rows on a trained model")
    parser.add_argument("--dspark-batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dspark-backend", default="",
                        help="the backend of the --dspark-model rows (default: the first of --backends)")
    parser.add_argument("--hf", action="store_true", help="add the HF transformers peer rows")
    parser.add_argument("--compare-async", action="store_true",
                        help="also the first backend with asynchronous scheduling off (first prompt length)")
    parser.add_argument("--hf-max-kv-gib", type=float, default=40.0)
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[1, 64],
                        help="engine points (first prompt length) whose decode steps are traced for GPU idle time")
    parser.add_argument("--trace-prefill", type=int, default=16,
                        help="batch size whose prefill (first prompt length) the first backend traces; 0: none")
    parser.add_argument("--trace-decode", type=int, default=0,
                        help="batch size whose decode steps (first prompt length) the first backend traces by op")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in the CSV (each with its own card, date, commit and command)")
    parser.add_argument("--commit", default="", help="the commit to record where the tree is not a git checkout")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every engine, e.g. backend.fallback=reference")
    args = parser.parse_args(argv)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    stamp = dict(zip(STAMP, (torch.cuda.get_device_name(), datetime.date.today().isoformat(), commit or "-",
                             torch.__version__, " ".join(["python", *sys.argv]))))
    path = RESULTS / f"bench_engine_{args.tag}.csv"
    measured = ceilings()
    bandwidth = measured["copy_bw"]
    earlier = _read(path) if args.append else []
    rows = []

    def record(row: dict) -> None:
        rows.append(row)
        if row["kind"] != "floor":
            print(_line(row) if row["kind"] != "ceiling" else row, flush=True)
        _write(path, stamp, rows, earlier)

    record(dict(kind="ceiling", backend="copy", model="-", gb_s=round(bandwidth / 1e9, 1)))
    record(dict(kind="ceiling", backend="bf16_matmul", model="-", tflop_s=round(measured["dense_bf16"] / 1e12, 1)))
    record(dict(kind="ceiling", backend="fp8_scaled_mm", model="-", tflop_s=round(measured["dense_fp8"] / 1e12, 1)))
    first = args.backends[0] if args.backends else ""
    for backend in args.backends:
        reference = backend == "reference"
        for dspark in ([False, True] if args.dspark else [False]):
            engine_rows(backend, args.model, args.reference_prompts if reference else args.prompts,
                        args.reference_batches if reference else args.batches, args.steps, dspark, args.overrides,
                        bandwidth, record, profile=() if reference else tuple(args.profile_batches),
                        memory_share=0.3 if reference else 0.45,
                        trace_prefill=args.trace_prefill if backend == first and not dspark else 0,
                        trace_decode=args.trace_decode if backend == first and not dspark else 0,
                        floors=backend == first)
        if backend == first and args.compare_async:
            engine_rows(backend, args.model, args.prompts[:1], args.batches, args.steps, False, args.overrides,
                        bandwidth, record, profile=tuple(args.profile_batches), asynchronous=False, floors=False)
    if args.dspark_model:
        for dspark in (False, True):
            engine_rows(args.dspark_backend or first, args.dspark_model, [args.prompts[0]], args.dspark_batches,
                        args.steps, dspark, args.overrides, bandwidth, record, profile=tuple(args.profile_batches),
                        memory_share=0.1, floors=False)
    if args.hf:
        hf_rows(args.prompts, args.batches, args.steps, args.hf_max_kv_gib, record)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _write(path: Path, stamp: dict, rows: list[dict], earlier: list[dict]) -> None:
    stamped = earlier + [{**stamp, **r} for r in rows]
    fields = list(stamp) + sorted({k for r in stamped for k in r} - set(stamp))
    write_csv(path, fields, stamped)
    plot(stamped, path.with_suffix(".png"))


def _read(path: Path) -> list[dict]:
    """The rows of an earlier run's CSV, numbers and booleans parsed back (the stamp columns stay
    text), empty cells dropped."""
    if not path.exists():
        return []

    def parse(text: str):
        if text in ("True", "False"):
            return text == "True"
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    with open(path, newline="") as f:
        return [{k: v if k in STAMP else parse(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine end to end: prefill and decode throughput against the HF peer, the measured
ceilings and the floor, all in one run (on one GPU; the fast mode runs on the CPU).

Rows (``kind``):

* ``engine``: ``LLM`` on the composed config (``model``, ``backend`` and the overrides), then on
  the reference backend of the same device (``study.reference``), per prompt length, batch size
  and DSpark off/on. ``prefill_tok_s``: prompt tokens over the median wall time of
  ``study.prefill_repeats`` prefills, each of a batch of fresh greedy requests of random tokens
  that ask for one token (the steps until every first token is out). Then ``study.steps``
  decode steps of another such batch are timed one by one (``step_ms``: median;
  ``decode_tok_s``: emitted tokens over the decode steps' wall time; ``tok_s_per_user``: that
  over the batch).
* ``hf``: transformers' ``DeepseekV3ForCausalLM`` with the widths of :data:`HF_WIDTHS` (random
  weights, bf16, eager PyTorch with SDPA attention, its own KV cache), same prompts and steps.
* ``ceiling``: device copy bandwidth (GB/s, a large device-to-device copy), and the dense bf16
  matmul and FP8 e4m3 ``torch._scaled_mm`` rates (TFLOP/s, 8192-cubed).
* ``floor``: per engine point of the composed backend, the bytes a decode step must read
  (non-expert weights, the experts a batch routes to in expectation with uniform routing, the LM
  head, and each sequence's attended KV) over the measured copy bandwidth.

DSpark rows run the composed ``decoding`` (``decoding=dspark`` with ``decoding.varlen=false``, the
study's default); ``study.dspark_model=tiny`` (the trained ``tiny``) adds rows with drafts off
and on, to read the wall-clock speedup of DSpark; ``study.compare_async=true`` adds the composed
backend's rows with asynchronous scheduling off (engines run with it on, the GPU default);
``study.trace_prefill=B`` prints the heaviest kernels of one traced prefill,
``study.trace_decode=B`` the kernels of a few eager decode steps by HAL op. Prints a table,
writes ``experiments/results/bench_engine_<tag>.csv`` after every row (``study.append=true``
keeps an earlier run's rows, each with its own stamp) and the Pareto-style plot (decode tok/s
against tok/s per user) beside it.

    python experiments/bench_engine.py [study.tag=h200] [study.reference=true] [study.batches=[1,4,16,64,128]]
        [study.prompts=[512,4096]] [study.steps=32] [study.hf=true] [study.dspark_model=tiny]
        [study.compare_async=true] [study.append=true] [study.trace_prefill=B] [study.trace_decode=B] [overrides...]
"""
from __future__ import annotations

import csv
import dataclasses
import gc
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config.schema import AppConfig, BackendConfig, ModelConfig
from deepinfer.models.registry import model_preset
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import ceilings  # noqa: E402
from op_profile import decode_kernels, gpu_busy, prefill_kernels  # noqa: E402

HF_WIDTHS = dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64,
                 num_key_value_heads=64, q_lora_rank=1280, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=6,
                 moe_intermediate_size=2048, intermediate_size=2048, n_shared_experts=1, n_group=1, topk_group=1,
                 first_k_dense_replace=0)
"""The HF peer: ``model=small``'s attention and MoE widths in DeepSeek-V3's layout."""
META = ("card", "date", "commit", "command")
"""The columns :func:`deepinfer.results.write_results` puts first (kept as text when read back)."""


@dataclass
class Settings(StudySettings):
    """The engine points, peers and traces of one run."""

    FAST = ("model=tiny_random", "backend=reference", "study.ceilings=false", "study.prompts=[16]",
            "study.batches=[1,2]", "study.steps=2", "study.profile_batches=[]", "study.trace_prefill=0")
    PLOTS = True

    tag: Optional[str] = "h200"
    """Suffix of the result files' names (for example the card: ``h200``)."""
    reference: bool = True
    """Also the reference backend's rows, on the composed backend's device (unless that is the reference)."""
    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 128])
    """Batch sizes of the composed backend."""
    prompts: list[int] = field(default_factory=lambda: [512, 4096])
    """Prompt lengths of the composed backend."""
    reference_batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    """Batch sizes of the reference backend (it is slow)."""
    reference_prompts: list[int] = field(default_factory=lambda: [512])
    """Prompt lengths of the reference backend."""
    steps: int = 32
    """Decode steps timed per point."""
    prefill_repeats: int = 5
    """Prefills timed per point of the composed backend (their median gives ``prefill_tok_s``);
    the reference backend's points time one."""
    dspark: bool = False
    """Also every engine point with DSpark on (the composed ``decoding``)."""
    dspark_model: Optional[str] = None
    """A model preset (e.g. ``tiny``, run at ``model.dtype``) whose DSpark off/on rows are added; None: none."""
    dspark_batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    """Batch sizes of the ``dspark_model`` rows (first prompt length)."""
    hf: bool = False
    """Add the HF transformers peer rows (a CUDA GPU)."""
    hf_max_kv_gib: float = 40.0
    """Largest KV cache of an HF point; larger points are skipped."""
    compare_async: bool = False
    """Also the composed backend with asynchronous scheduling off (first prompt length)."""
    ceilings: bool = True
    """Measure the copy bandwidth and matmul rates (a CUDA GPU), and the floor rows they give."""
    profile_batches: list[int] = field(default_factory=lambda: [1, 64])
    """Engine points (first prompt length) whose decode steps are traced for GPU idle time."""
    trace_prefill: int = 16
    """Batch size whose prefill (first prompt length) the composed backend traces; 0: none."""
    trace_decode: int = 0
    """Batch size whose decode steps (first prompt length) the composed backend traces by op; 0: none."""
    append: bool = False
    """Keep the rows already in the CSV (each with its own card, date, commit and command)."""


def engine_config(app: AppConfig, backend: BackendConfig, model: ModelConfig, prompts: list[int],
                  batches: list[int], steps: int, dspark: bool, memory_share: float,
                  asynchronous: bool) -> AppConfig:
    """``app`` with ``backend`` and ``model``, sized for the points, with DSpark (``app``'s
    decoding) or without, taking ``memory_share`` of the card."""
    decoding = app.decoding if dspark else dataclasses.replace(app.decoding, name="greedy", num_draft_tokens=0,
                                                               confidence_temperatures=None)
    engine = dataclasses.replace(app.engine, use_tqdm=False, max_num_seqs=max(batches),
                                 max_num_batched_tokens=max(8192, max(prompts)), prefill_chunk_tokens=max(prompts),
                                 gpu_memory_utilization=memory_share, async_scheduling=asynchronous)
    model = dataclasses.replace(model, max_model_len=max(prompts) + steps * 8 + 64)
    return dataclasses.replace(app, backend=backend, model=model, decoding=decoding, engine=engine)


def engine_rows(app: AppConfig, prompts: list[int], batches: list[int], steps: int, bandwidth: Optional[float],
                record, profile: tuple[int, ...] = (), trace_prefill: int = 0, trace_decode: int = 0,
                floors: bool = True, prefill_repeats: int = 1) -> None:
    """One engine's points (the engine ``app`` describes), each passed to ``record`` as it is
    measured (then the floor rows, with ``floors`` and a ``bandwidth``). Engines run one after
    another in this process. Each point runs once untimed first, so no kernel compiles while it
    is timed; ``prefill_repeats`` prefills are timed per point. ``trace_prefill``: a batch size
    whose prefill at the first prompt length is traced once more, after the timed points, its
    heaviest kernels printed; ``trace_decode``: a batch size whose decode steps are traced
    eagerly by op."""
    llm = LLM.from_config(app)
    rows = []
    for prompt in prompts:
        for batch in batches:
            _point(llm, prompt, batch, 4)  # untimed: the kernels of this point's shapes compile here
            prefill_s = statistics.median(_prefill_seconds(llm, prompt, batch)
                                          for _ in range(max(1, prefill_repeats)))
            row = _point(llm, prompt, batch, steps, profile=batch in profile and prompt == prompts[0])
            row["prefill_tok_s"] = round(batch * prompt / prefill_s)
            row.update(kind="engine", backend=app.backend.name, model=app.model.name,
                       dspark=bool(app.decoding.num_draft_tokens), prompt=prompt, batch=batch,
                       asynchronous=app.engine.async_scheduling)
            rows.append(row)
            record(row)
    if trace_prefill:
        print(prefill_kernels(llm, _prompts(llm, prompts[0], trace_prefill)), flush=True)
    if trace_decode:
        print(decode_kernels(llm, _prompts(llm, prompts[0], trace_decode)), flush=True)
    for row in floor_rows(llm, rows, bandwidth) if floors and bandwidth else []:
        record(row)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _prefill_seconds(llm: LLM, prompt: int, batch: int) -> float:
    """Wall time of the steps that prefill ``batch`` fresh ``prompt``-token requests, each asking
    for one token, until every request has it."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in _prompts(llm, prompt, batch)]
    started = time.perf_counter()
    while not all(r.finished for r in requests):
        llm.step()
    return time.perf_counter() - started


def _point(llm: LLM, prompt: int, batch: int, steps: int, profile: bool = False) -> dict:
    """Decode of ``batch`` fresh ``prompt``-token requests, prefilled first: the median step time
    and the emission rates of ``steps`` full-batch decode steps (the step that collects the
    prefill's tokens left out), with ``profile`` the GPU's idle share over 8 of them."""
    budget = llm.config.engine.max_num_batched_tokens
    params = SamplingParams(temperature=0, max_tokens=(steps + 2) * (1 + (llm.dspark.k if llm.dspark else 0))
                            + math.ceil(batch * prompt / budget), ignore_eos=True)
    requests = [llm.add_request(ids, params) for ids in _prompts(llm, prompt, batch)]
    decode_times, emitted, decoding = [], 0, False
    tracing = None
    while not all(r.finished for r in requests):
        before = sum(len(r.output_token_ids) for r in requests)
        started = time.perf_counter()
        stats = llm.step()
        elapsed = time.perf_counter() - started
        if stats.num_prefill_tokens:
            continue
        if not decoding:
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
                profile, tracing = False, gpu_busy(tracing)
    decode_s = sum(decode_times)
    row = dict(step_ms=round(1e3 * statistics.median(decode_times), 3),
               decode_tok_s=round(emitted / decode_s, 1), tok_s_per_user=round(emitted / decode_s / batch, 2),
               accepted_per_step=round(emitted / len(decode_times) / batch - 1, 3))
    if isinstance(tracing, dict):
        row.update(tracing)
    return row


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
    """Decode tok/s against tok/s per user, one panel per prompt length, saved as ``path``."""
    plt = pyplot()
    if plt is None:
        return
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
    save_figure(fig, path)


def run(app: AppConfig, settings: Settings, record) -> None:
    """Every row of the run, each passed to ``record``: the ceilings, the composed backend's
    engines, the reference's, the ``dspark_model`` rows and the HF peer."""
    bandwidth = None
    if settings.ceilings:
        measured = ceilings()
        bandwidth = measured["copy_bw"]
        record(dict(kind="ceiling", backend="copy", model="-", gb_s=round(bandwidth / 1e9, 1)))
        record(dict(kind="ceiling", backend="bf16_matmul", model="-", tflop_s=round(measured["dense_bf16"] / 1e12, 1)))
        record(dict(kind="ceiling", backend="fp8_scaled_mm", model="-",
                    tflop_s=round(measured["dense_fp8"] / 1e12, 1)))
    steps, profile = settings.steps, tuple(settings.profile_batches)
    drafts = [False, True] if settings.dspark else [False]
    for dspark in drafts:
        engine_rows(engine_config(app, app.backend, app.model, settings.prompts, settings.batches, steps, dspark, 0.45,
                                  True), settings.prompts, settings.batches, steps, bandwidth, record, profile=profile,
                    trace_prefill=0 if dspark else settings.trace_prefill,
                    trace_decode=0 if dspark else settings.trace_decode, prefill_repeats=settings.prefill_repeats)
    if settings.compare_async:
        prompts = settings.prompts[:1]
        engine_rows(engine_config(app, app.backend, app.model, prompts, settings.batches, steps, False, 0.45, False),
                    prompts, settings.batches, steps, bandwidth, record, profile=profile, floors=False,
                    prefill_repeats=settings.prefill_repeats)
    if settings.reference and app.backend.name != "reference":
        reference = BackendConfig(name="reference", device=app.backend.device)
        prompts, batches = settings.reference_prompts, settings.reference_batches
        for dspark in drafts:
            engine_rows(engine_config(app, reference, app.model, prompts, batches, steps, dspark, 0.3, True),
                        prompts, batches, steps, bandwidth, record, floors=False)
    if settings.dspark_model:
        model = dataclasses.replace(ModelConfig(**model_preset(settings.dspark_model)), dtype=app.model.dtype)
        prompts, batches = settings.prompts[:1], settings.dspark_batches
        for dspark in (False, True):
            engine_rows(engine_config(app, app.backend, model, prompts, batches, steps, dspark, 0.1, True),
                        prompts, batches, steps, bandwidth, record, profile=profile, floors=False,
                        prefill_repeats=settings.prefill_repeats)
    if settings.hf:
        hf_rows(settings.prompts, settings.batches, steps, settings.hf_max_kv_gib, record)


def main(argv=None) -> int:
    app, settings = compose_study("bench_engine", Settings, argv)
    path, command = settings.results_path("bench_engine"), study_command("bench_engine", argv)
    shown = _read(path) if settings.append else []
    appending = settings.append

    def record(row: dict) -> None:
        nonlocal appending
        if row["kind"] != "floor":
            print(_line(row) if row["kind"] != "ceiling" else row, flush=True)
        write_results(path, [row], command, append=appending)
        appending = True
        shown.append(row)
        plot(shown, path.with_suffix(".png"))

    run(app, settings, record)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _read(path: Path) -> list[dict]:
    """The rows of an earlier run's CSV, numbers and booleans parsed back (the :data:`META`
    columns stay text), empty cells dropped."""
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
        return [{k: v if k in META else parse(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


if __name__ == "__main__":
    sys.exit(main())

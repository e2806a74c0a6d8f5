"""Train the embedded default model (`model=tiny`) and its DSpark drafter on the Python standard library.

    python experiments/train_tiny.py [study.minutes=55] [study.threads=1] [study.out=models/tiny] [study.fast=true]
        [overrides...]

Overrides change the architecture as on the CLI (``model.config.hidden_size=192``).

1. Corpus: the standard library's .py sources (``sysconfig.get_paths()["stdlib"]``, without
   site-packages and test suites); every 25th file (sorted by path) is held out.
2. Tokenizer: byte-level BPE trained with ``tokenizers`` on the training files; ids 0..3 are
   <|bos|>, <|eos|>, <|pad|> and the DSpark noise token.
3. Model (the ``config`` of ``configs/model/tiny.yaml``): every V4.1 layer kind at toy width, trained causally with
   ``TrainingForward`` for ``study.model_share`` of the time budget (AdamW, warm-up then cosine by
   elapsed time; the last ``study.qat_share`` of it rounds weights and KV as the checkpoint and the
   caches store them). The gates' noaux_tc biases follow the expert loads.
4. Drafter, for the rest of the budget: the target (saved) writes ``study.greedy_sequences`` sequences
   itself through the engine (<|bos|> and a random training line, continued greedily to SEQ_LEN
   tokens); with the target frozen the DSpark block is distilled on them, teacher-forced, toward
   the target's distributions (at ``study.distill_temperature``), from anchors in the generated part.
   At temperature 0 a draft is accepted iff it is the target's argmax after the target's own
   tokens, which is what these sequences hold. ``study.target_from=DIR`` keeps DIR's target and
   tokenizer and trains only the drafter.
5. Save (official layout + tokenizer.json), reload, and record in config.json the held-out loss
   computed by the inference forward (the sample itself goes to heldout_sample.json); measure
   DSpark acceptance through the engine at temperature 0 on held-out prompts. Curves and
   numbers go to experiments/results/ (``train_tiny[_<tag>].csv``, ``..._dspark.csv`` and a PNG).

The budget is wall-clock, so a busier machine trains for fewer steps; ``study.fast=true`` runs a
few steps on a slice of the corpus into a scratch folder, for checking the pipeline.
"""
from __future__ import annotations

import json
import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from deepinfer.models.deepseek_v41.weights import inference_loss
from deepinfer.results import pyplot, save_figure, write_results
from deepinfer.study import StudySettings, compose_study, study_command

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|noise|>"]
HELDOUT_FILE = "heldout_sample.json"
SEQ_LEN = 128
"""Training length; the preset's index_topk covers every compressed key at this length."""


@dataclass
class Settings(StudySettings):
    """The training budget, its split and the optimisers."""

    FAST = ("study.max_files=50", "study.model_steps=2", "study.draft_steps=2", "study.eval_every=1",
            "study.greedy_sequences=4", "study.heldout_windows=4", "study.out=outputs/train_tiny_smoke",
            "study.threads=1", "study.tag=smoke")
    PLOTS = True

    minutes: float = 55.0
    """Wall-clock budget of both trainings."""
    model_share: float = 0.65
    """Share of the budget for the target; the rest writes the greedy corpus and trains the drafter."""
    qat_share: float = 0.2
    """Last share of the target's training that rounds weights and KV as the checkpoint stores them."""
    batch: int = 8
    """Sequences per optimiser step."""
    anchors: int = 24
    """Draft blocks per sequence per drafter step."""
    lr: float = 3e-3
    """Peak learning rate of the target."""
    draft_lr: float = 3e-3
    """Peak learning rate of the drafter."""
    distill_temperature: float = 0.25
    """Temperature of the target distribution the drafter is distilled toward."""
    greedy_sequences: int = 384
    """Target-written sequences the drafter is distilled on."""
    target_from: Optional[str] = None
    """Checkpoint folder whose target (and tokenizer) to keep: train only the drafter."""
    warmup: int = 10
    """Warm-up steps of both learning rates."""
    bias_rate: float = 1e-3
    """Step of the gates' noaux_tc bias update toward balanced expert loads."""
    eval_every: int = 5
    """Steps between curve points."""
    heldout_windows: int = 16
    """Held-out windows of the sample recorded in config.json."""
    curve_windows: int = 4
    """Held-out windows of the curve points."""
    seed: int = 0
    """Seed of the weights, the batches and the greedy corpus's prompts."""
    threads: int = 2
    """Torch CPU threads."""
    device: str = "cpu"
    """Where training runs (evaluation runs on the CPU)."""
    model_steps: Optional[int] = None
    """Cap on target steps; None: time only."""
    draft_steps: Optional[int] = None
    """Cap on drafter steps; None: time only."""
    max_files: Optional[int] = None
    """Only the first this many standard-library files (sorted by path); None: all of them."""
    out: str = "models/tiny"
    """Checkpoint folder written (relative to the repository)."""


def architecture(app) -> dict:
    """The trained architecture: the composed model's ``config`` block (``configs/model/tiny.yaml``'s,
    with overrides such as ``model.config.hidden_size=192``)."""
    return dict(app.model.config)


def corpus_files(limit: Optional[int] = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library (its first ``limit`` files by
    path; None: all), deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))[:limit]
    held = files[::25]
    return [f for f in files if f not in set(held)], held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((read(f) for f in files), trainer)
    return tokenizer


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """Every file as <|bos|> text <|eos|>, concatenated."""
    ids = []
    for encoding in tokenizer.encode_batch([read(f) for f in files]):
        ids.extend([0, *encoding.ids, 1])
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` evenly spaced windows of SEQ_LEN + 1 tokens (inputs and labels): the fixed held-out sample."""
    starts = torch.linspace(0, len(stream) - SEQ_LEN - 1, count).long()
    return torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts])


def batches(stream: torch.Tensor, batch: int, seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (batch,), generator=gen)
        yield torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts]).to(device)


def progress(started: float, seconds: float, step: int, max_steps: int | None) -> float:
    """Fraction of a phase done: of its time budget, or of its step cap if that comes first."""
    return max((time.time() - started) / seconds, step / max_steps if max_steps else 0.0)


def learning_rate(peak: float, fraction: float, step: int, warmup: int) -> float:
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0))))


class Log:
    """Rows of the training curves, echoed to stdout."""

    def __init__(self):
        self.rows, self.started = [], time.time()

    def add(self, **row):
        row["elapsed_s"] = round(time.time() - self.started, 1)
        self.rows.append(row)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def train_model(trainer, stream, heldout, args, log: Log, seconds: float) -> None:
    from torch.func import functional_call

    from deepinfer.models.deepseek_v41.training import balance_gate_biases

    model = trainer.model
    params = [p for n, p in model.named_parameters() if not n.startswith("mtp.") and not n.endswith("gate.bias")]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    moes = [layer.ffn for layer in model.layers]
    started, step = time.time(), 0
    for batch in batches(stream, args.batch, args.seed, args.device):
        fraction = progress(started, seconds, step, args.model_steps)
        if fraction >= 1:
            break
        qat = fraction >= 1 - args.qat_share
        trainer.round_kv = qat
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, fraction, step, args.warmup)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        out = functional_call(trainer, rounded_weights(model), (inputs,)) if qat else trainer(inputs)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        balance_gate_biases(moes, out.expert_ids, args.bias_rate)
        if step % args.eval_every == 0:
            log.add(phase="model", step=step, train_loss=loss.item(),
                    heldout_loss=heldout_loss(trainer, heldout[:args.curve_windows]), qat=int(qat))
        step += 1
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        for name, value in rounded_weights(model).items():
            trainer.get_parameter(name).copy_(value)
    log.add(phase="model", step=step, train_loss=loss.item(),
            heldout_loss=heldout_loss(trainer, heldout[:args.curve_windows]), qat=1)


def rounded_weights(model) -> dict:
    """The weights as the checkpoint stores them (straight-through), under ``TrainingForward`` names."""
    from deepinfer.models.deepseek_v41.training import checkpoint_rounded

    return {f"model.{name}": value for name, value in checkpoint_rounded(model).items()}


def heldout_loss(trainer, windows: torch.Tensor) -> float:
    windows = windows.to(trainer.model.embed.weight.device)
    with torch.no_grad():
        out = trainer(windows[:, :-1])
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                                 windows[:, 1:].reshape(-1)).item()


def greedy_corpus(out_dir: Path, tokenizer, files: list[Path], count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` sequences of SEQ_LEN tokens that the saved target writes itself: <|bos|> and a
    random source line of ``files`` (at most 24 tokens), continued greedily through the engine
    to SEQ_LEN tokens. Returns (ids ``[count, SEQ_LEN]``, prompt lengths ``[count]``)."""
    from deepinfer import LLM, SamplingParams

    rng = random.Random(seed)
    lines = [ln.rstrip() for f in files for ln in read(f).splitlines() if ln.strip()]
    prompts = [[0, *tokenizer.encode(rng.choice(lines)).ids][:24] for _ in range(count)]
    llm = LLM("tiny", "reference", [f"model.checkpoint={out_dir}", "engine.use_tqdm=false",
                                    f"engine.max_num_seqs={min(count, 64)}"])
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=SEQ_LEN - len(p), ignore_eos=True)
                                     for p in prompts])
    ids = torch.tensor([p + o.token_ids for p, o in zip(prompts, outputs)])
    return ids, torch.tensor([len(p) for p in prompts])


def train_drafter(trainer, corpus: tuple[torch.Tensor, torch.Tensor], args, log: Log, seconds: float) -> None:
    """Distil the frozen target into the DSpark block on the target's own greedy sequences, the
    inputs at temperature 0: a draft there is accepted iff it is the target's argmax given the
    target's earlier tokens. Anchors lie in the generated part, where the engine drafts."""
    from torch.func import functional_call

    from deepinfer.models.deepseek_v41.training import draft_objective

    model, cfg = trainer.model, trainer.model.cfg
    block = cfg.dspark_block_size
    ids, prompt_lens = corpus
    trainer.round_kv = True
    with torch.no_grad():
        passes = [trainer(chunk.to(args.device)) for chunk in ids.split(16)]
    features = torch.cat([p.features for p in passes])
    target_logits = torch.cat([p.logits.to(torch.bfloat16) for p in passes])
    del passes
    params = [p for n, p in model.mtp.named_parameters() if not n.endswith("gate.bias")]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 1)
    started, step = time.time(), 0
    while (fraction := progress(started, seconds, step, args.draft_steps)) < 1:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.draft_lr, fraction, step, args.warmup)
        rows_of = torch.randint(0, len(ids), (args.batch,), generator=gen)
        low = prompt_lens[rows_of, None]
        anchors = (low + torch.rand(args.batch, args.anchors, generator=gen) * (SEQ_LEN - block + 1 - low)).long()
        batch, anchors = ids[rows_of].to(args.device), anchors.to(args.device)
        rows = anchors[..., None] + torch.arange(block, device=batch.device)
        draft = (features[rows_of], anchors, block, cfg.dspark_noise_token_id)
        logits, hidden = functional_call(trainer, rounded_weights(model), (batch, draft))
        flat = rows.reshape(args.batch, -1)
        targets = target_logits[rows_of].gather(1, flat[..., None].expand(-1, -1, target_logits.shape[-1]))
        previous = batch.gather(1, flat).view_as(rows)
        objective = draft_objective(model, logits, hidden, previous, targets.float().view(*rows.shape, -1),
                                    args.distill_temperature)
        optimizer.zero_grad(set_to_none=True)
        objective.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % args.eval_every == 0:
            log_draft(log, step, objective)
        step += 1
    for p in params:
        p.requires_grad_(False)
    log_draft(log, step, objective)


def log_draft(log: Log, step: int, objective) -> None:
    log.add(phase="drafter", step=step, distill=objective.distill.item(),
            confidence_bce=objective.confidence_bce.item(), acceptance=objective.acceptance.mean().item(),
            greedy_accepted_length=objective.greedy_accepted_length)


def measure_dspark(out_dir: Path, prompts: list[str], max_tokens: int) -> dict:
    """Greedy generation with DSpark through the engine: acceptance and losslessness."""
    from deepinfer import LLM, SamplingParams

    base = [f"model.checkpoint={out_dir}", "engine.use_tqdm=false", f"engine.max_num_seqs={len(prompts)}"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM("tiny", "reference", base).generate(prompts, params)
    drafted = LLM("tiny", "reference", base + ["decoding=dspark"]).generate(prompts, params)
    log = [entry for o in drafted for entry in o.verify_log]
    accepted = sum(a for _, a in log) / max(len(log), 1)
    by_position = [sum(a >= i for v, a in log if v >= i) / max(sum(v >= i for v, _ in log), 1)
                   for i in range(1, max((v for v, _ in log), default=0) + 1)]
    return {"prompts": len(prompts), "max_tokens": max_tokens, "verify_steps": len(log),
            "mean_accepted_length": accepted, "tokens_per_verification": accepted + 1,
            "share_accepting_at_least_i": ";".join(f"{r:.3f}" for r in by_position),
            "lossless": all(a.token_ids == b.token_ids for a, b in zip(plain, drafted)),
            "sample_text": drafted[0].text}


def heldout_prompts(files: list[Path], count: int) -> list[str]:
    """The first line of ``count`` held-out files that start a def or class (fallback: any line)."""
    lines = []
    for f in files:
        found = [ln for ln in read(f).splitlines() if ln.startswith(("def ", "class "))]
        if found:
            lines.append(found[0])
        if len(lines) == count:
            break
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """The target's loss curves and the drafter's acceptance and distillation curves, as ``path``."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    model = [r for r in rows if r["phase"] == "model"]
    left.plot([r["elapsed_s"] / 60 for r in model], [r["train_loss"] for r in model], label="train")
    left.plot([r["elapsed_s"] / 60 for r in model], [r["heldout_loss"] for r in model], label="held-out")
    left.set_xlabel("minutes")
    left.set_ylabel("next-token loss (nats)")
    left.set_title("model")
    left.legend()
    draft = [r for r in rows if r["phase"] == "drafter"]
    minutes = [r["elapsed_s"] / 60 for r in draft]
    right.plot(minutes, [r["acceptance"] for r in draft], label="mean acceptance prob (T=1)")
    right.plot(minutes, [r["greedy_accepted_length"] / 5 for r in draft], label="greedy accepted length / 5")
    right.plot(minutes, [r["distill"] / 5 for r in draft], label="distillation loss / 5")
    right.set_xlabel("minutes")
    right.set_title("DSpark drafter (teacher-forced on the target's greedy sequences)")
    right.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    app, settings = compose_study("train_tiny", Settings, argv)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    random.seed(settings.seed)
    run(app, settings, study_command("train_tiny", argv))
    return 0


def run(app, args: Settings, command: str) -> None:
    """Train, save and measure as the module's docstring says; ``args`` are the study's settings."""
    from deepinfer.hal import OpTable
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.training import TrainingForward, init_training_weights
    from deepinfer.models.deepseek_v41.weights import load_pretrained, save_pretrained

    from tokenizers import Tokenizer

    log = Log()
    train_files, held_files = corpus_files(args.max_files)
    arch = architecture(app)
    ops = OpTable("reference")
    if args.target_from:
        tokenizer = Tokenizer.from_file(str(REPO / args.target_from / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(train_files, arch["vocab_size"])
    stream, held_stream = token_stream(tokenizer, train_files), token_stream(tokenizer, held_files)
    heldout = heldout_windows(held_stream, args.heldout_windows)
    print(f"corpus: {len(train_files)} training files ({len(stream)} tokens), {len(held_files)} held out "
          f"({len(held_stream)} tokens); {time.time() - log.started:.0f} s", flush=True)
    out_dir = (REPO / args.out).resolve()
    if args.target_from:
        model = load_pretrained(REPO / args.target_from, ops, max_model_len=1024)
        trainer = TrainingForward(model.to(args.device), SEQ_LEN)
    else:
        model = init_training_weights(DeepseekV41ForCausalLM(DeepseekV41Config(**arch), ops, max_model_len=1024),
                                      args.seed)
        trainer = TrainingForward(model.to(args.device), SEQ_LEN)
        budget = args.minutes * 60 - (time.time() - log.started)
        train_model(trainer, stream, heldout, args, log, budget * args.model_share)
    save_pretrained(model.cpu(), out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    corpus = greedy_corpus(out_dir, tokenizer, train_files, args.greedy_sequences, args.seed)
    print(f"greedy corpus: {len(corpus[0])} sequences; {time.time() - log.started:.0f} s", flush=True)
    train_drafter(trainer, corpus, args, log, args.minutes * 60 - (time.time() - log.started))
    save_pretrained(model.cpu(), out_dir)
    reloaded = load_pretrained(out_dir, ops, max_model_len=1024)
    loss = inference_loss(reloaded, heldout)
    record = {"script": "experiments/train_tiny.py", "minutes": args.minutes, "device": args.device, "seq_len": SEQ_LEN,
              "heldout_loss": loss, "heldout_windows": args.heldout_windows,
              "heldout_sample": "heldout_windows(): evenly spaced windows of SEQ_LEN + 1 tokens of the held-out "
                                "files' token stream; loss by the inference forward (full prefill, all logits)"}
    record_training(out_dir, record)
    prompts = heldout_prompts(held_files, 8)
    write_heldout_sample(out_dir, heldout, prompts)
    dspark = measure_dspark(out_dir, prompts, max_tokens=48)
    record_training(out_dir, {**record, "dspark_mean_accepted_length": dspark["mean_accepted_length"],
                              "dspark_tokens_per_verification": dspark["tokens_per_verification"],
                              "dspark_measure": "greedy, 5 drafts, the 8 prompts of heldout_sample.json, 48 tokens each, "
                                                "through the engine; mean_accepted_length = accepted drafts per "
                                                "verification, tokens_per_verification = that + 1"})
    write_training_results(args, log.rows, loss, dspark, command)


def write_heldout_sample(out_dir: Path, windows: torch.Tensor, prompts: list[str]) -> None:
    """The fixed held-out sample beside the checkpoint, so tests need no standard library of this version."""
    sample = {"windows": windows.tolist(), "prompts": prompts}
    (out_dir / HELDOUT_FILE).write_text(json.dumps(sample) + "\n")


def record_training(out_dir: Path, record: dict) -> None:
    """Store ``record`` under ``deepinfer_training`` in the checkpoint's config.json (loaders ignore it)."""
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config["deepinfer_training"] = record
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_training_results(args: Settings, rows: list[dict], loss: float, dspark: dict, command: str) -> None:
    """The curves (``train_tiny[_<tag>].csv`` and a PNG) and the summary (``..._dspark.csv``): the
    final held-out loss (inference path) and greedy (temperature 0) generation with DSpark, 5 drafts,
    on held-out prompts, through the engine; mean_accepted_length = accepted drafts per verification,
    tokens_per_verification = that + 1 (the target's own token), share_accepting_at_least_i = share
    of verifications accepting >= i drafts, i = 1..5."""
    path = args.results_path("train_tiny")
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k != "phase", k != "step", k))
    write_results(path, [{k: r.get(k, "") for k in fields} for r in rows], command)
    summary = write_results(path.with_name(f"{path.stem}_dspark.csv"),
                            [{"heldout_loss": loss, **dspark, "threads": args.threads,
                              "python": platform.python_version()}], command)
    plot(rows, path.with_suffix(".png"))
    print(f"held-out loss (inference path) {loss:.4f}; DSpark {dspark}; wrote {path}, {summary}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

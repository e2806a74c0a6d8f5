"""The embedded default model (models/tiny, trained by experiments/train_tiny.py)."""
import json
import math

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.weights import inference_loss, load_pretrained
from deepinfer.models.registry import REPO_ROOT, model_preset, resolve_checkpoint

CHECKPOINT = resolve_checkpoint(model_preset("tiny")["checkpoint"])
QUIET = ["engine.use_tqdm=false"]
GREEDY_PROMPT = "def main():"
GREEDY_TEXT = "\n                    # Addression, we can't be a newline\n                # the current line.  There is"
"""What the shipped weights write greedily after GREEDY_PROMPT (24 tokens); update with the weights."""
LOSS_TOLERANCE = 2e-3
"""Nats. The recorded value was computed by the same float32 inference forward on the same
windows, so only thread-count-dependent accumulation order separates the two; a different set
of weights (random ones score about ln(vocab) = 7.6) is far outside it."""


@pytest.fixture(scope="module")
def sample():
    return json.loads((CHECKPOINT / "heldout_sample.json").read_text())


def test_the_tiny_preset_is_the_shipped_checkpoint():
    assert CHECKPOINT.resolve() == REPO_ROOT / "models" / "tiny"
    files = {p.name for p in CHECKPOINT.iterdir()}
    assert {"config.json", "tokenizer.json"} <= files and any(f.endswith(".safetensors") for f in files)
    assert sum(p.stat().st_size for p in CHECKPOINT.iterdir()) <= 30 * 2**20


def test_heldout_loss_matches_the_recorded_value(sample):
    """The inference forward over the fixed held-out windows gives the loss training recorded."""
    recorded = json.loads((CHECKPOINT / "config.json").read_text())["deepinfer_training"]["heldout_loss"]
    model = load_pretrained(CHECKPOINT, OpTable("reference"), max_model_len=1024)
    windows = torch.tensor(sample["windows"])
    loss = inference_loss(model, windows)
    assert abs(loss - recorded) < LOSS_TOLERANCE, (loss, recorded)
    assert loss < 0.7 * math.log(model.cfg.vocab_size)


def test_greedy_output_is_fixed():
    out = LLM("tiny", "reference", QUIET).generate([GREEDY_PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.text == GREEDY_TEXT


@pytest.fixture(scope="module")
def dspark_log(sample):
    """(verified, accepted) of every verification of greedy DSpark generation (5 drafts) over the
    held-out prompts, 48 tokens each: the measurement experiments/train_tiny.py records."""
    prompts = sample["prompts"]
    llm = LLM("tiny", "reference", QUIET + ["decoding=dspark", f"engine.max_num_seqs={len(prompts)}"])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return [entry for o in outputs for entry in o.verify_log]


def test_dspark_writes_at_least_two_tokens_per_verification_on_heldout_prompts(dspark_log):
    """Tokens per verification = accepted drafts + the target's own token (EAGLE's tau)."""
    tokens_per_verification = sum(accepted + 1 for _, accepted in dspark_log) / len(dspark_log)
    assert tokens_per_verification >= 2.0, tokens_per_verification


def test_dspark_accepts_at_least_two_drafts_per_verification_on_heldout_prompts(dspark_log):
    accepted_drafts = sum(accepted for _, accepted in dspark_log) / len(dspark_log)
    assert accepted_drafts >= 2.0, accepted_drafts

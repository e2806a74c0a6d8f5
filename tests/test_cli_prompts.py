"""The CLI takes prompts as raw text (``prompt=TEXT`` or bare arguments): Hydra's override
grammar never sees them."""
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.__main__ import split_prompts

ROOT = Path(__file__).resolve().parents[1]
AWKWARD = ['def f(x, y="a,b"):', "x = {'k': [1, 2]}", "naïve café — ünïcode", "(", '"quoted" and \'single\'']


@pytest.mark.parametrize("text", AWKWARD)
def test_prompt_equals_takes_any_text(text):
    assert split_prompts([f"prompt={text}", "decoding.max_tokens=3"]) == ([text], ["decoding.max_tokens=3"])


def test_bare_arguments_are_prompts_and_flag_values_are_not():
    prompts, rest = split_prompts(["print(1)", "model=tiny", "--cfg", "job", "héllo [x]", "-m"])
    assert prompts == ["print(1)", "héllo [x]"] and rest == ["model=tiny", "--cfg", "job", "-m"]


def test_the_cli_generates_for_prompts_hydra_could_not_parse():
    done = subprocess.run([sys.executable, "-m", "deepinfer", f"prompt={AWKWARD[0]}", "héllo, 'w' [x]",
                           "decoding.max_tokens=2", "engine.use_tqdm=false"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"--- prompt 0: {AWKWARD[0]!r}" in done.stdout and "--- prompt 1: \"héllo, 'w' [x]\"" in done.stdout
    assert done.stdout.count("[2 tokens, finish: length]") == 2

"""One run of the parallel-plan launch check: greedy and seeded-sampled tokens of the prompts in a
file, written as JSON by rank 0 (``experiments/parallel_one_gpu_run.sh`` compares the plans' files
with the one-process run's).

    [torchrun --nproc-per-node N] python experiments/parallel_launch_check.py PROMPTS OUT.json [overrides...]
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.groups import leave


def main(argv: list[str]) -> int:
    prompts_file, out, *overrides = argv
    prompts = [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    llm = LLM(overrides=["engine.use_tqdm=false", *overrides])
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    sampled = llm.generate(prompts, [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True,
                                                    seed=1234 + i) for i in range(len(prompts))])
    if llm.groups is None or llm.groups.rank == 0:
        Path(out).write_text(json.dumps({"collectives": "none" if llm.groups is None else dist.get_backend(),
                                         "greedy": [list(o.token_ids) for o in greedy],
                                         "sampled": [list(o.token_ids) for o in sampled]}))
    leave(llm.groups)
    del llm
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

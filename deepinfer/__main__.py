"""``python -m deepinfer model=tiny backend=reference prompt="..."``: the Hydra app.

Composes ``configs/config.yaml`` (the tree and schema :func:`deepinfer.config.compose.compose`
uses), turns it into an :class:`~deepinfer.config.schema.AppConfig` and runs its ``task``.
Prompts are raw text: ``prompt=TEXT`` and bare arguments (a positional prompt) never go through
Hydra's override grammar, so parentheses, quotes, commas, brackets and ``=`` need no escaping."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from deepinfer.config.compose import CONFIG_NAME, HYDRA_VERSION_BASE
from deepinfer.config.schema import to_app_config
from deepinfer.config.store import register_schemas
from deepinfer.models.registry import CONFIG_ROOT

HYDRA_VALUE_FLAGS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
                     "--config-dir", "--info", "--experimental-rerun"}
"""Hydra's flags that take the next argument as their value."""
RAW_PROMPTS: list[str] = []
"""Prompts taken off the command line before Hydra parses it (:func:`split_prompts`)."""


def split_prompts(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(prompts, hydra arguments)``: each ``prompt=TEXT`` and each bare argument (no ``=``, not a
    flag or a flag's value) is a prompt taken as it is; the rest are Hydra's."""
    prompts, rest = [], []
    for i, arg in enumerate(argv):
        flag_value = i > 0 and argv[i - 1] in HYDRA_VALUE_FLAGS
        if arg.startswith("prompt=") and not flag_value:
            prompts.append(arg[len("prompt="):])
        elif arg.startswith("-") or "=" in arg or flag_value:
            rest.append(arg)
        else:
            prompts.append(arg)
    return prompts, rest

register_schemas()


@hydra.main(config_path=str(CONFIG_ROOT), config_name=CONFIG_NAME, version_base=HYDRA_VERSION_BASE)
def main(cfg: DictConfig) -> None:
    app = to_app_config(cfg)
    if app.task == "parity":
        from deepinfer.tasks.parity import run_parity

        sys.exit(run_parity(app, list(RAW_PROMPTS) or None))
    if app.task == "bench":
        from deepinfer.tasks.bench import run_bench

        run_bench(app)
        return
    run_app(app)


def run_app(app) -> None:
    """The generate task: read prompts, generate, print the results (and write them to
    ``output_file`` when given); under a parallel plan (torchrun) only rank 0 prints and writes."""
    from deepinfer.engine.llm import LLM
    from deepinfer.parallel.groups import leave

    prompts = read_prompts(app)
    llm = LLM.from_config(app)
    if app.backend.execution == "emulate" and (llm.groups is None or not llm.groups.rank):
        print(f"NOTE: backend {app.backend.name!r} is emulated on the CPU (backend.execution=emulate): its kernels' "
              f"plans and numerics, not its hardware's speed or bits.")
    if llm.random_weights and (llm.groups is None or not llm.groups.rank):
        print(f"NOTE: model {app.model.name!r} has random weights (no model.checkpoint), so the generated "
              f"text is noise; model=tiny is the trained default.")
    outputs = llm.generate(prompts)
    groups = llm.groups
    leave(groups)
    del llm
    gc.collect()  # the process group's last references go before the interpreter's teardown
    if groups is not None and groups.rank:
        return
    print("\n".join(f"--- prompt {out.request_id}: {out.prompt!r}\n{out.text}\n[{len(out.token_ids)} tokens, "
                    f"finish: {out.finish_reason}]" for out in outputs))
    if app.output_file:
        Path(app.output_file).write_text(json.dumps([out.__dict__ for out in outputs], indent=2))


def read_prompts(app) -> list[str]:
    """The command line's raw prompts (:data:`RAW_PROMPTS`), ``prompts_file`` (one prompt per
    non-empty line) or ``prompt``."""
    if RAW_PROMPTS:
        if app.prompts_file:
            raise ValueError("give prompts on the command line or prompts_file=path, not both")
        return list(RAW_PROMPTS)
    if app.prompts_file:
        prompts = [line for line in Path(app.prompts_file).read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompts_file={app.prompts_file!r} holds no prompts (one per line)")
        return prompts
    if app.prompt:
        return [app.prompt]
    raise ValueError('give prompt="..." or prompts_file=path (one prompt per line)')


if __name__ == "__main__":
    RAW_PROMPTS[:], sys.argv[1:] = split_prompts(sys.argv[1:])
    main()

"""``python -m deepinfer task=parity backend_a=reference backend_b=sm100 [ops=[rms_norm,...]]``:
the op parity grid (:mod:`deepinfer.hal.parity`) between two backends, each in its plain or
batch-invariant table (``batch_invariant_a``, ``batch_invariant_b``) and natively or emulated
(``execution_a``, ``execution_b``; an emulated side's generation takes the ops its emulation
lacks from the reference), plus a greedy generation of
the configured model on both (``generate_tokens`` tokens a prompt; 0 skips it). Prints the table
and the token agreement, writes ``parity.csv`` (:func:`deepinfer.results.write_results`) and a
heat map ``parity.png`` into ``output_dir``, and fails (exit status 1) when a case fails."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from deepinfer.hal.parity import ParityRow, Side, parity_grid
from deepinfer.results import command_line, pyplot, write_results

PARITY_PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
                  "for i in range(10):")
"""Prompts of the end-to-end comparison when the command line gives none."""


def run_parity(app, prompts: list[str] | None = None) -> int:
    """Run the grid and the generation for ``app``; returns the exit status (1: a case failed)."""
    if not app.backend_b:
        raise ValueError("task=parity compares two backends: give backend_b=NAME (and backend_a=NAME, default "
                         "reference); batch_invariant_b=true compares a backend's batch-invariant table")
    a, b = (Side(name, invariant, options={"execution": "emulate"} if execution == "emulate" else None)
            for name, invariant, execution in ((app.backend_a, app.batch_invariant_a, app.execution_a),
                                               (app.backend_b, app.batch_invariant_b, app.execution_b)))
    rows = parity_grid(a, b, app.ops or None, app.sizes or None)
    print(format_table(rows, a, b))
    records = [dataclasses.asdict(row) for row in rows]
    if app.generate_tokens:
        agreement, tokens = generation_agreement(app, a, b, list(prompts or PARITY_PROMPTS))
        print(f"greedy generation, model={app.model.name}: {agreement:.1%} of {tokens} tokens agree")
        records.append({"op": "generate", "case": f"model={app.model.name}", "status": "agreement",
                        "token_agreement": agreement, "tokens": tokens})
    out = Path(app.output_dir or f"outputs/parity_{_slug(a)}_vs_{_slug(b)}")
    print(f"wrote {write_results(out / 'parity.csv', records, command_line('deepinfer'))}")
    figure = heat_map(rows, a, b, out / "parity.png")
    if figure is not None:
        print(f"wrote {figure}")
    return 1 if any(row.status == "fail" for row in rows) else 0


def format_table(rows: list[ParityRow], a: Side, b: Side) -> str:
    """The grid as text: one line per op x case, then the counts."""
    lines = [f"{b.label} against {a.label}",
             f"{'op':28} {'case':34} {'status':6} {'max err':>10} {'mean err':>10} {'tol used':>9}  tolerance"]
    for row in rows:
        numbers = "" if row.status == "skip" else \
            f"{row.max_error:10.3g} {row.mean_error:10.3g} {row.tolerance_used:9.3g}  atol {row.atol:g} rtol {row.rtol:g}"
        lines.append(f"{row.op:28} {row.case:34} {row.status:6} {numbers}{row.detail if row.status == 'skip' else ''}")
    counts = {status: sum(row.status == status for row in rows) for status in ("pass", "fail", "skip")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


def generation_agreement(app, a: Side, b: Side, prompts: list[str]) -> tuple[float, int]:
    """Greedy tokens of ``prompts`` with the configured model on both sides: the share of output
    positions where they agree, and the positions compared."""
    from deepinfer.config.compose import compose
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=app.generate_tokens, ignore_eos=True)
    outputs = []
    for side in (a, b):
        backend = compose([f"backend={side.backend}", *(["backend.execution=emulate", "backend.fallback=reference"]
                                                          if side.emulated else [])]).backend
        config = dataclasses.replace(app, task="generate", backend=backend,
                                     engine=dataclasses.replace(app.engine, batch_invariant=side.batch_invariant,
                                                                 use_tqdm=False))
        llm = LLM.from_config(config)
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
        del llm
    pairs = [(x, y) for first, second in zip(*outputs) for x, y in zip(first, second)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1), len(pairs)


def heat_map(rows: list[ParityRow], a: Side, b: Side, path: Path) -> Path | None:
    """``log10`` of each case's largest error as a share of its tolerance, ops by row, cases by
    column (grey: skipped); None, with a note, where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    ops = list(dict.fromkeys(row.op for row in rows))
    width = max((sum(row.op == op for row in rows) for op in ops), default=1)
    grid = [[math.nan] * width for _ in ops]
    for i, op in enumerate(ops):
        for j, row in enumerate(r for r in rows if r.op == op):
            if row.status != "skip":
                grid[i][j] = math.log10(max(row.tolerance_used, 1e-6))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * width + 3), 0.3 * len(ops) + 1.5))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="lightgrey")
    image = ax.imshow(grid, cmap=cmap, vmin=-6, vmax=1, aspect="auto")
    ax.set_yticks(range(len(ops)), ops, fontsize=7)
    ax.set_xticks(range(width), [str(j) for j in range(width)], fontsize=7)
    ax.set_xlabel("case (in the op's case table order)")
    ax.set_title(f"{b.label} vs {a.label}", fontsize=9)
    fig.colorbar(image, ax=ax, label="log10(max error / tolerance); > 0 fails")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slug(side: Side) -> str:
    return side.backend + ("_invariant" if side.batch_invariant else "") + ("_emulated" if side.emulated else "")

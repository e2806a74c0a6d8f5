"""Structured JSON outputs against the official JSON-Schema-Test-Suite, without a model.

Every test of the suite's draft folders (``optional/`` and ``refRemote`` left out) goes through the pipeline a
generated output goes through (:func:`deepinfer.decoding.conformance.pipeline_outcome`): the
schema compiles as a request's would (``engine.structured`` of the composed config), the
instance, written as the strict grammar writes JSON (and, if the grammar refuses that, compact,
as it holds ``const`` and ``enum`` values), is fed to the matcher token by token with the byte
tokenizer, then the end token, then the finished text is validated. Reported per draft:
invalid instances that would end "stop" (must be 0), valid instances rejected and why, and
schemas refused at compile, by suite file (the keyword it tests). Writes
``experiments/results/structured_conformance.csv`` (one row per test) and prints the summary.

The suite ships in jsonschema's source distribution:
    pip download --no-deps --no-binary :all: jsonschema && tar xzf jsonschema-*.tar.gz
    python experiments/structured_conformance.py --suite jsonschema-*/json/tests [--drafts draft7 draft2020-12]
        [--generate MAX_TOKENS] [hydra overrides, e.g. engine.structured.any_whitespace=true]

``--generate`` also sends each distinct schema to the trained ``tiny`` model at temperature 1
and checks every output that ends "stop" with ``jsonschema``
(``structured_conformance_generation.csv``).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import subprocess
import sys
from pathlib import Path

from bench_ops import write_csv
from deepinfer.config.compose import compose
from deepinfer.decoding.conformance import OUTCOMES, canonical_text, pipeline_outcome
from deepinfer.decoding.grammar_service import GrammarService
from deepinfer.tokenizer import ByteTokenizer

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 300
REASON_CHARS = 160


DRAFT_URIS = {"draft7": "http://json-schema.org/draft-07/schema#",
              "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
              "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}
"""The ``$schema`` a folder's schemas mean when they do not say (the pipeline reads a schema
without one as 2020-12)."""
NEEDS_REMOTES = ("refRemote",)
"""Suite files whose schemas ``$ref`` the suite's remote documents (served over HTTP by its
runners); the engine never fetches a schema, so such outputs end "error" (not run here)."""


def suite_cases(folder: Path):
    """``(file stem, case description, schema, test description, data, valid)`` of every test,
    each object schema naming its folder's draft."""
    draft = DRAFT_URIS.get(folder.name)
    for path in sorted(folder.glob("*.json")):
        if path.stem in NEEDS_REMOTES:
            continue
        for case in json.loads(path.read_text()):
            schema = case["schema"]
            if isinstance(schema, dict) and draft and "$schema" not in schema:
                schema = {"$schema": draft, **schema}
            for test in case["tests"]:
                yield path.stem, case["description"], schema, test["description"], test["data"], test["valid"]


def run(suite: Path, drafts: list[str], overrides: list[str]) -> list[dict]:
    structured = compose(overrides).engine.structured
    tokenizer = ByteTokenizer()
    service = GrammarService(tokenizer, VOCAB, structured.compile_timeout_s, structured.compile_workers,
                             structured.any_whitespace, structured.backend)
    rows = []
    try:
        for draft in drafts:
            for keyword, case, schema, test, data, valid in suite_cases(suite / draft):
                outcome, reason = pipeline_outcome(service, tokenizer, schema, canonical_text(data))
                if outcome == "grammar":  # a const or enum value is written as the grammar holds it: compact
                    compact = pipeline_outcome(service, tokenizer, schema,
                                               json.dumps(data, ensure_ascii=False, separators=(",", ":")))
                    outcome, reason = compact if compact[0] != "grammar" else (outcome, reason)
                rows.append(dict(draft=draft, keyword=keyword, case=case, test=test, valid=valid, outcome=outcome,
                                 reason=(reason or "")[:REASON_CHARS]))
    finally:
        service.shutdown()
    return rows


def generate(suite: Path, drafts: list[str], overrides: list[str], max_tokens: int) -> list[dict]:
    """Each distinct schema of the suite as a structured request to the trained ``tiny`` model at
    temperature 1 (one seed each), on the CPU reference backend; every output that ends "stop" is
    checked independently with ``jsonschema`` (``valid``)."""
    import jsonschema

    from deepinfer import LLM, SamplingParams

    schemas = {}
    for draft in drafts:
        for keyword, _, schema, _, _, _ in suite_cases(suite / draft):
            schemas.setdefault(json.dumps(schema), (draft, keyword, schema))
    llm = LLM("tiny", "reference", ["engine.use_tqdm=false", *overrides])
    items = list(schemas.values())
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                             structured={"type": "json", "schema": schema if isinstance(schema, dict) else json.dumps(schema)})
              for seed, (_, _, schema) in enumerate(items)]
    rows = []
    for (draft, keyword, schema), out in zip(items, llm.generate(["config = "] * len(items), params)):
        valid = ""
        if out.finish_reason == "stop":
            validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
            valid = validator.is_valid(json.loads(out.text))
        rows.append(dict(draft=draft, keyword=keyword, finish=out.finish_reason, valid=valid,
                         text=out.text[:REASON_CHARS], error=(out.error or "")[:REASON_CHARS]))
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for draft in sorted({r["draft"] for r in rows}):
        mine = [r for r in rows if r["draft"] == draft]
        valid = [r for r in mine if r["valid"]]
        invalid = [r for r in mine if not r["valid"]]
        lied = [r for r in invalid if r["outcome"] == "stop"]
        caught = [r for r in invalid if r["outcome"] == "validation"]
        rejected = [r for r in valid if r["outcome"] != "stop"]
        counts = collections.Counter(r["outcome"] for r in rejected)
        lines.append(f"{draft}: {len(mine)} tests; invalid instances ending stop: {len(lied)} of {len(invalid)}; "
                     f"valid instances rejected: {len(rejected)} of {len(valid)} "
                     f"({100 * len(rejected) / max(len(valid), 1):.1f} %: "
                     + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES if counts[o]) + ")")
        lines.append(f"  invalid instances the grammar accepts, ended by validation: {len(caught)} of {len(invalid)} ("
                     + ", ".join(f"{k} {n}" for k, n in collections.Counter(r["keyword"] for r in caught).most_common())
                     + ")")
        refused = collections.Counter(r["keyword"] for r in mine if r["outcome"] == "compile")
        lines.append("  schemas refused at compile, tests by suite file: "
                     + ", ".join(f"{k} {n}" for k, n in refused.most_common()))
        by_grammar = collections.Counter(r["keyword"] for r in rejected if r["outcome"] == "grammar")
        lines.append("  valid instances the grammar refuses, by suite file: "
                     + ", ".join(f"{k} {n}" for k, n in by_grammar.most_common()))
        for r in lied:
            lines.append(f"  ENDS STOP BUT INVALID: {r['keyword']} / {r['case']} / {r['test']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", type=Path, required=True, help="the suite's tests folder (json/tests)")
    parser.add_argument("--drafts", nargs="+", default=["draft7", "draft2020-12"])
    parser.add_argument("--tag", default="")
    parser.add_argument("--generate", type=int, default=0, metavar="MAX_TOKENS",
                        help="also generate once per distinct schema with the trained tiny model (temperature 1)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (engine.structured.*)")
    args = parser.parse_args(argv)
    rows = run(args.suite, args.drafts, args.overrides)
    lines = summary(rows)
    print("\n".join(lines))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = dict(date=datetime.date.today().isoformat(), commit=commit or "-", command=" ".join(["python", *sys.argv]))
    name = "structured_conformance" + (f"_{args.tag}" if args.tag else "")
    write_csv(RESULTS / f"{name}.csv", [*stamp, *rows[0]], [{**stamp, **r} for r in rows])
    (RESULTS / f"{name}.txt").write_text("\n".join([f"# {stamp['command']} ({stamp['date']}, commit {stamp['commit']})",
                                                    *lines]) + "\n")
    print(f"wrote {RESULTS / name}.csv and .txt")
    if args.generate:
        generated = generate(args.suite, args.drafts, args.overrides, args.generate)
        finishes = collections.Counter(r["finish"] for r in generated)
        broken = [r for r in generated if r["finish"] == "stop" and not r["valid"]]
        line = (f"generation, tiny at temperature 1, {len(generated)} schemas: "
                + ", ".join(f"{k} {n}" for k, n in finishes.most_common())
                + f"; outputs ending stop that jsonschema rejects: {len(broken)}")
        print(line)
        write_csv(RESULTS / f"{name}_generation.csv", [*stamp, *generated[0]], [{**stamp, **r} for r in generated])
        with open(RESULTS / f"{name}.txt", "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

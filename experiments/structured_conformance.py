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
    python experiments/structured_conformance.py study.suite=jsonschema-<version>/json/tests
        [study.drafts=[draft7,draft2020-12]] [study.generate=MAX_TOKENS] [study.tag=T]
        [overrides, e.g. engine.structured.any_whitespace=true]

``study.generate`` also sends each distinct schema to the trained ``tiny`` model at temperature 1
and checks every output that ends "stop" with ``jsonschema``
(``structured_conformance_generation.csv``). The fast mode runs a few built-in tests in the
suite's format (``SAMPLE``) instead of the suite.
"""
from __future__ import annotations

import collections
import datetime
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from deepinfer.config.schema import ConfigError
from deepinfer.decoding.conformance import OUTCOMES, canonical_text, pipeline_outcome
from deepinfer.decoding.grammar_service import GrammarService
from deepinfer.results import git_commit, write_results
from deepinfer.study import StudySettings, compose_study, study_command
from deepinfer.tokenizer import ByteTokenizer

VOCAB = 300
REASON_CHARS = 160


@dataclass
class Settings(StudySettings):
    """Where the suite is and which of its drafts run."""

    FAST = ("study.drafts=[draft2020-12]",)

    suite: Optional[str] = None
    """The suite's tests folder (``json/tests`` of jsonschema's source distribution); None, in the
    fast mode only: the built-in ``SAMPLE``."""
    drafts: list[str] = field(default_factory=lambda: ["draft7", "draft2020-12"])
    """Draft folders of the suite to run."""
    generate: int = 0
    """Also generate once per distinct schema with the trained tiny model (temperature 1), at most
    this many tokens each; 0: no generation."""


DRAFT_URIS = {"draft7": "http://json-schema.org/draft-07/schema#",
              "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
              "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}
"""The ``$schema`` a folder's schemas mean when they do not say (the pipeline reads a schema
without one as 2020-12)."""
NEEDS_REMOTES = ("refRemote",)
"""Suite files whose schemas ``$ref`` the suite's remote documents (served over HTTP by its
runners); the engine never fetches a schema, so such outputs end "error" (not run here)."""
UNIQUE_INTEGERS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
SAMPLE = {  # suite file stem: its cases
    "type": [{"description": "integer type", "schema": {"type": "integer"},
              "tests": [{"description": "an integer", "data": 1, "valid": True},
                        {"description": "a string", "data": "x", "valid": False}]}],
    "uniqueItems": [{"description": "unique integers", "schema": UNIQUE_INTEGERS,
                     "tests": [{"description": "unique", "data": [1, 2], "valid": True},
                               {"description": "repeated", "data": [1, 1], "valid": False}]}],
    "enum": [{"description": "enum of two strings", "schema": {"enum": ["io", "os"]},
              "tests": [{"description": "a member", "data": "os", "valid": True},
                        {"description": "not a member", "data": "re", "valid": False}]}],
}
"""A few tests in the suite's format: what the fast mode runs for every draft in place of the suite."""


def suite_files(suite: Optional[Path], draft: str) -> list[tuple[str, list]]:
    """``(file stem, its cases)`` of the suite's folder ``draft``; ``SAMPLE``'s where ``suite`` is None."""
    if suite is None:
        return list(SAMPLE.items())
    return [(path.stem, json.loads(path.read_text())) for path in sorted((suite / draft).glob("*.json"))
            if path.stem not in NEEDS_REMOTES]


def suite_cases(suite: Optional[Path], draft: str):
    """``(file stem, case description, schema, test description, data, valid)`` of every test of
    folder ``draft``, each object schema naming that draft."""
    uri = DRAFT_URIS.get(draft)
    for stem, cases in suite_files(suite, draft):
        for case in cases:
            schema = case["schema"]
            if isinstance(schema, dict) and uri and "$schema" not in schema:
                schema = {"$schema": uri, **schema}
            for test in case["tests"]:
                yield stem, case["description"], schema, test["description"], test["data"], test["valid"]


def run(suite: Optional[Path], drafts: list[str], structured) -> list[dict]:
    """One row per test of ``drafts``: its outcome through the pipeline with grammars compiled as
    ``structured`` (``engine.structured``) says."""
    tokenizer = ByteTokenizer()
    service = GrammarService(tokenizer, VOCAB, structured.compile_timeout_s, structured.compile_workers,
                             structured.any_whitespace, structured.backend)
    rows = []
    try:
        for draft in drafts:
            for keyword, case, schema, test, data, valid in suite_cases(suite, draft):
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


def generate(suite: Optional[Path], drafts: list[str], app, max_tokens: int) -> list[dict]:
    """Each distinct schema of the suite as a structured request to the engine ``app`` describes
    (the trained ``tiny`` model on the CPU reference backend by default) at temperature 1 (one
    seed each); every output that ends "stop" is checked independently with ``jsonschema`` (``valid``)."""
    import jsonschema

    from deepinfer import LLM, SamplingParams

    schemas = {}
    for draft in drafts:
        for keyword, _, schema, _, _, _ in suite_cases(suite, draft):
            schemas.setdefault(json.dumps(schema), (draft, keyword, schema))
    llm = LLM.from_config(app)
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
    """The report's lines: per draft, what ended "stop" that should not have, what was rejected and why."""
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


def suite_folder(settings: Settings) -> Optional[Path]:
    """``study.suite`` as a folder; None (the built-in sample) only in the fast mode."""
    if settings.suite is None and not settings.fast:
        raise ConfigError("study.suite is missing: pass the suite's tests folder, study.suite=jsonschema-<version>/json/tests "
                          "(pip download --no-deps --no-binary :all: jsonschema && tar xzf jsonschema-*.tar.gz); "
                          "only the fast mode (study.fast=true) runs without it, on a built-in sample")
    return Path(settings.suite) if settings.suite is not None else None


def report_generation(app, settings: Settings, suite: Optional[Path], path: Path, command: str) -> None:
    """Generate once per distinct schema, write ``<path's stem>_generation.csv`` and add a line to the report."""
    generated = generate(suite, settings.drafts, app, settings.generate)
    finishes = collections.Counter(r["finish"] for r in generated)
    broken = [r for r in generated if r["finish"] == "stop" and not r["valid"]]
    line = (f"generation, tiny at temperature 1, {len(generated)} schemas: "
            + ", ".join(f"{k} {n}" for k, n in finishes.most_common())
            + f"; outputs ending stop that jsonschema rejects: {len(broken)}")
    print(line)
    write_results(path.with_name(f"{path.stem}_generation.csv"), generated, command)
    with path.with_suffix(".txt").open("a") as f:
        f.write(line + "\n")


def main(argv=None) -> int:
    app, settings = compose_study("structured_conformance", Settings, argv)
    suite = suite_folder(settings)
    rows = run(suite, settings.drafts, app.engine.structured)
    lines = summary(rows)
    print("\n".join(lines))
    command = study_command("structured_conformance", argv)
    path = write_results(settings.results_path("structured_conformance"), rows, command)
    header = f"# {command} ({datetime.date.today().isoformat()}, commit {git_commit()})"
    path.with_suffix(".txt").write_text("\n".join([header, *lines]) + "\n")
    print(f"wrote {path} and {path.with_suffix('.txt').name}")
    if settings.generate:
        report_generation(app, settings, suite, path, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Each kernel choice of ``backend.options`` against the HAL reference on the GPU, through the
sm100 backend's op table: sparse MLA decode and prefill with ``mla_kernel`` auto (the
warp-specialised kernel on Hopper) and portable, and the bf16 grouped GEMM. Prints one line per
check, writes them to ``kernel_options_<card>.csv`` under ``experiments/results/`` or
``study.output_dir``, and exits non-zero on a mismatch.

    python experiments/kernel_options_h200_check.py [study.output_dir=DIR]   (on the GPU machine, with TileLang)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)
from deepinfer.hal.formats import encode_tokens
from deepinfer.hal.registry import get_backend
from deepinfer.hal.spec import SPECS
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command


@dataclass
class Settings(StudySettings):
    """The checks are fixed: small inputs, every choice of ``mla_kernel``."""

    DEVICE = "cuda"


def _random_rows(gen, fmt: str, count: int) -> torch.Tensor:
    return encode_tokens(torch.randn(count, 512, generator=gen), fmt)


def _random_indices(gen, rows: int, keys: int, count: int) -> torch.Tensor:
    return torch.randint(0, count, (rows, 1, keys), generator=gen, dtype=torch.int32)


def _decode_args(gen):
    rows, heads, main_keys, extra_keys = 8, 64, 96, 128
    return dict(q=torch.randn(rows, 1, heads, 512, generator=gen).to(torch.bfloat16),
                cache=_random_rows(gen, "fp8", 4096), indices=_random_indices(gen, rows, main_keys, 4096),
                extra_cache=_random_rows(gen, "fp4", 2048), extra_indices=_random_indices(gen, rows, extra_keys, 2048),
                sink=torch.randn(heads, generator=gen), scale=512 ** -0.5, cache_format="fp8", extra_format="fp4")


def _prefill_args(gen):
    tokens, heads, keys, buffer = 40, 64, 90, 300
    return dict(q=torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16),
                kv=torch.randn(buffer, 512, generator=gen).to(torch.bfloat16),
                indices=torch.randint(0, buffer, (tokens, keys), generator=gen, dtype=torch.int32),
                sink=torch.randn(heads, generator=gen), scale=512 ** -0.5)


def _gemm_args(gen):
    sizes = torch.tensor([40, 0, 130, 7], dtype=torch.int64)
    return dict(x=torch.randn(int(sizes.sum()), 256, generator=gen).to(torch.bfloat16),
                weight=(0.06 * torch.randn(4, 384, 256, generator=gen)).to(torch.bfloat16), group_sizes=sizes)


def _cuda(value):
    return value.cuda() if isinstance(value, torch.Tensor) else value


def _float(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


def check(op: str, args: dict, options: dict) -> dict:
    """``op`` of sm100 with ``options`` against the reference on ``args``: a row with the largest
    absolute error of each output and whether all are within 3e-2 of the output's scale."""
    got = get_backend("sm100", options).implementations()[op](**{k: _cuda(v) for k, v in args.items()})
    want = SPECS[op].reference(**{k: _float(v) for k, v in args.items()})
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    errors = [float((g.float().cpu() - w.float()).abs().max()) for g, w in zip(got, want)]
    ok = all(e <= 3e-2 * max(1.0, float(w.float().abs().max())) for e, w in zip(errors, want))
    print(f"{op:20s} {str(options):36s} max abs error {['%.2e' % e for e in errors]} {'pass' if ok else 'FAIL'}",
          flush=True)
    return {"op": op, "options": str(options), "max_abs_errors": " ".join("%.2e" % e for e in errors),
            "status": "pass" if ok else "FAIL"}


def main(argv=None) -> int:
    _, settings = compose_study("kernel_options_h200_check", Settings, argv)
    gen = torch.Generator().manual_seed(0)
    decode, prefill, gemm = _decode_args(gen), _prefill_args(gen), _gemm_args(gen)
    rows = [check(op, args, {"mla_kernel": mla}) for mla in ("auto", "portable")
            for op, args in (("mla_sparse_decode", decode), ("mla_sparse_prefill", prefill))]
    rows.append(check("grouped_gemm", gemm, {}))
    card = torch.cuda.get_device_name().replace(" ", "_")
    path = write_results(settings.results_path(f"kernel_options_{card.split('_')[-1].lower()}"), rows,
                         study_command("kernel_options_h200_check", argv))
    print(f"wrote {path}")
    return 0 if all(row["status"] == "pass" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

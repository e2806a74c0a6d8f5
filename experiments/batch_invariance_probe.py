"""Which ops change a row's result with the batch around it, measured on this machine.

For each op, one fixed probe row is computed alone, then inside batches of other sizes, at the
first, middle and last position, among random partner rows (for the indexer and prefill
attention also among other keys). A configuration differs when the probe row's output is not
bitwise equal to its output alone. Both tables of the reference backend are probed: the plain
references (``engine.batch_invariant=false``) and the batch-invariant table (``true``). Rows
named ``torch:`` probe the PyTorch primitives that explain the differences.

    python experiments/batch_invariance_probe.py [study.scales=[tiny,v41]] [study.threads=N] [study.device=cuda]

Prints a table and writes ``experiments/results/batch_invariance_probe_<device>.csv``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from deepinfer.config.schema import ConfigError
from deepinfer.hal import SPECS, get_backend
from deepinfer.hal.formats import encode_tokens
from deepinfer.hal.ops.mhc import sinkhorn
from deepinfer.hal.ops.rope import rope_cos_sin, rope_inv_freq
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

PROBE_SEED, SHARED_SEED = 1234, 99
DIMS = {  # hidden, vocab, q_lora, heads, experts, top_k, index heads, window, index top-k
    "tiny": dict(hidden=64, vocab=512, rank=32, heads=2, experts=8, top_k=2, index_heads=2, window=8, topk=8),
    "v41": dict(hidden=4096, vocab=129280, rank=1280, heads=64, experts=384, top_k=6, index_heads=64, window=128,
                topk=512),
}
SIZES = {"tiny": (1, 2, 3, 4, 5, 8, 17, 32, 33, 64, 100), "v41": (1, 2, 3, 5, 17, 33)}


@dataclass
class Settings(StudySettings):
    """The op dims probed and where the ops run."""

    FAST = ("study.scales=[tiny]",)

    scales: list[str] = field(default_factory=lambda: ["v41", "tiny"])
    """Op dims, in this order: the tiny model's (``tiny``) and V4.1's (``v41``)."""
    threads: Optional[int] = None
    """Torch CPU threads; None: torch's default."""
    device: str = "cpu"
    """Torch device the ops run on."""


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def row_case(make_rows, shared=lambda gen: {}):
    """Probe builder for ops whose row arguments are ``make_rows(gen, n)`` (dim 0) and whose other
    arguments ``shared(gen)`` do not depend on the batch."""
    def build(gen, n, pos):
        args = make_rows(gen, n)
        for name, value in make_rows(torch.Generator().manual_seed(PROBE_SEED), 1).items():
            args[name][pos] = value[0]
        args.update(shared(torch.Generator().manual_seed(SHARED_SEED)))
        return args, lambda out: tuple(o[pos] for o in out) if isinstance(out, tuple) else out[pos]
    return build


def grouped_case(d):
    experts, k, n_out = min(d["experts"], 8), d["hidden"], min(2 * d["rank"], 256)

    def build(gen, n, pos):
        expert_of = torch.randint(0, experts, (n,), generator=gen)
        expert_of[pos] = 1
        order = torch.argsort(expert_of, stable=True)
        x = _randn(gen, n, k)
        x[pos] = _randn(torch.Generator().manual_seed(PROBE_SEED), k)
        weight = _randn(torch.Generator().manual_seed(SHARED_SEED), experts, n_out, k) * k ** -0.5
        where = int((order == pos).nonzero())
        return ({"x": x[order], "weight": weight, "group_sizes": torch.bincount(expert_of, minlength=experts)},
                lambda out: out[where])
    return build


def indexer_case(d):
    heads, dim, probe_keys = d["index_heads"], 128, 16

    def build(gen, n, pos):
        probe = torch.Generator().manual_seed(PROBE_SEED)
        q, weights = _randn(gen, n, heads, dim), _randn(gen, n, heads)
        q[pos], weights[pos] = _randn(probe, heads, dim), _randn(probe, heads)
        before = int(torch.randint(0, 4 * n, (), generator=gen))
        k = torch.cat((_randn(gen, before, dim), _randn(probe, probe_keys, dim), _randn(gen, 3 * n, dim)))
        return {"q": q, "k": k, "weights": weights}, lambda out: out[pos, before:before + probe_keys]
    return build


def prefill_case(d):
    heads, dim, width = d["heads"], 512, d["window"] + d["topk"]

    def build(gen, n, pos):
        probe = torch.Generator().manual_seed(PROBE_SEED)
        before = int(torch.randint(0, 2 * width, (), generator=gen))
        kv = torch.cat((_randn(gen, before, dim), _randn(probe, width, dim), _randn(gen, width, dim)))
        q = _randn(gen, n, heads, dim)
        q[pos] = _randn(probe, heads, dim)
        indices = torch.randint(0, kv.shape[0], (n, width), generator=gen)
        indices[pos] = before + torch.randperm(width, generator=probe)
        indices[pos, : width // 4] = -1
        sink = _randn(torch.Generator().manual_seed(SHARED_SEED), heads)
        return ({"q": q, "kv": kv, "indices": indices.int(), "sink": sink, "scale": dim ** -0.5},
                lambda out: (out[0][pos], out[1][pos]))
    return build


def decode_case(d):
    heads, window, topk = d["heads"], d["window"], d["topk"]
    shared = torch.Generator().manual_seed(SHARED_SEED)
    cache = encode_tokens(_randn(shared, 4 * window, 512), "fp8").reshape(4, window, -1)
    extra_cache = encode_tokens(_randn(shared, 2 * topk, 512), "fp4").reshape(2, topk, -1)
    sink = _randn(shared, heads)

    def rows(gen, n):
        return {"q": _randn(gen, n, 1, heads, 512),
                "indices": torch.randint(-1, 4 * window, (n, 1, window), generator=gen).int(),
                "extra_indices": torch.randint(-1, 2 * topk, (n, 1, topk), generator=gen).int()}

    return row_case(rows, lambda _: {"cache": cache, "sink": sink, "scale": 512 ** -0.5, "cache_format": "fp8",
                                     "extra_cache": extra_cache, "extra_format": "fp4"})


def compress_case(d):
    dim, ratio, ring = 512, 2, 7

    def build(gen, n, pos):
        probe = torch.Generator().manual_seed(PROBE_SEED)
        latent, score = _randn(gen, 2 * n, dim), _randn(gen, 2 * n, dim)
        latent[2 * pos:2 * pos + 2], score[2 * pos:2 * pos + 2] = _randn(probe, 2, dim), _randn(probe, 2, dim)
        positions = torch.arange(2).repeat(n) + 10
        slots = torch.arange(n).repeat_interleave(2)
        args = {"latent": latent, "score": score, "positions": positions, "state_slots": slots,
                "chunk_start": torch.full((2 * n,), 10), "state": torch.zeros(n, ring, 2, dim), "ratio": ratio}
        return args, lambda out: out[0][2 * pos + 1]
    return build


def cases(d):
    """(name, op or torch callable, probe builder) for dims ``d``."""
    h, v = d["hidden"], d["vocab"]
    shared = lambda shape, scale=1.0: lambda g: {"weight": _randn(g, *shape) * scale}  # noqa: E731
    hc_weights = lambda g: {"fn": _randn(g, 24, 4 * h) / (4 * h) ** 0.5,  # noqa: E731
                            "scale": torch.tensor([0.7, 0.9, 1.3]), "base": _randn(g, 24), "norm_eps": 1e-6,
                            "hc_eps": 1e-6, "sinkhorn_iters": 20}
    table = rope_cos_sin(rope_inv_freq(10000.0), 256)
    sampling_rows = lambda g, n: {"logits": 3 * _randn(g, n, v), "temperature": torch.ones(n),  # noqa: E731
                                  "top_p": torch.full((n,), 0.9), "top_k": torch.full((n,), 50),
                                  "seeds": torch.randint(0, 1 << 62, (n,), generator=g),
                                  "positions": torch.randint(0, 1 << 20, (n,), generator=g)}
    found = [
        ("torch: x @ W.T", lambda x, weight: x @ weight.T, row_case(lambda g, n: {"x": _randn(g, n, h)},
                                                                  shared((d["rank"], h), h ** -0.5))),
        ("torch: silu, 70 per row", lambda x: F.silu(x), row_case(lambda g, n: {"x": 4 * _randn(g, n, 70)})),
        ("torch: softplus, 70 per row", lambda x: F.softplus(x), row_case(lambda g, n: {"x": 4 * _randn(g, n, 70)})),
        ("torch: log_softmax over vocab", lambda x: torch.log_softmax(x, -1),
         row_case(lambda g, n: {"x": _randn(g, n, v)})),
        ("linear", "linear", row_case(lambda g, n: {"x": _randn(g, n, h)}, shared((d["rank"], h), h ** -0.5))),
        ("grouped_gemm", "grouped_gemm", grouped_case(d)),
        ("rms_norm", "rms_norm", row_case(lambda g, n: {"x": _randn(g, n, h), "residual": _randn(g, n, h)},
                                          lambda g: {"weight": 1 + 0.1 * _randn(g, h), "eps": 1e-6})),
        ("mhc_mixes", "mhc_mixes", row_case(lambda g, n: {"residual": _randn(g, n, 4, h)}, hc_weights)),
        ("mhc_pre", "mhc_pre", row_case(lambda g, n: {"residual": _randn(g, n, 4, h),
                                                      "pre": torch.rand(n, 4, generator=g)})),
        ("mhc_post", "mhc_post", row_case(lambda g, n: {
            "y": _randn(g, n, h), "residual": _randn(g, n, 4, h), "post": 2 * torch.rand(n, 4, generator=g),
            "comb": sinkhorn(_randn(g, n, 4, 4), 1e-6, 20)})),
        ("moe_gate", "moe_gate", row_case(lambda g, n: {"logits": 2 * _randn(g, n, d["experts"])},
                                          lambda g: {"bias": 0.1 * _randn(g, d["experts"]), "top_k": d["top_k"],
                                                     "routed_scale": 1.5})),
        ("apply_rope", "apply_rope", row_case(lambda g, n: {"x": _randn(g, n, d["heads"], 512),
                                                            "positions": torch.randint(0, 256, (n,), generator=g)},
                                              lambda g: {"cos_sin": table})),
        ("kv_cast", "kv_cast", row_case(lambda g, n: {"x": _randn(g, n, 512)}, lambda g: {"fmt": "fp8"})),
        ("compress_tokens", "compress_tokens", compress_case(d)),
        ("indexer_logits", "indexer_logits", indexer_case(d)),
        ("mla_sparse_prefill", "mla_sparse_prefill", prefill_case(d)),
        ("mla_sparse_decode", "mla_sparse_decode", decode_case(d)),
        ("sample", "sample", row_case(sampling_rows)),
    ]
    return [case for case in found if not isinstance(case[1], str) or case[1] in SPECS]


def probe(fn, build, sizes, device):
    """(configurations, differing, max abs difference) of ``fn`` over batch sizes and positions."""
    def run(n, pos, seed):
        args, pick = build(torch.Generator().manual_seed(seed), n, pos)
        return _flat(pick(fn(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()})))

    alone = run(1, 0, 0)
    tried = differing = 0
    worst = 0.0
    for n in sizes:
        for pos in sorted({0, n // 2, n - 1}):
            got = run(n, pos, 1000 * n + pos)
            tried += 1
            if not all(torch.equal(a, b) for a, b in zip(got, alone)):
                differing += 1
                worst = max(worst, max((a.double() - b.double()).abs().max().item() for a, b in zip(got, alone)))
    return tried, differing, worst


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


def main(argv=None) -> int:
    _, settings = compose_study("batch_invariance_probe", Settings, argv)
    unknown = sorted(set(settings.scales) - set(DIMS))
    if unknown:
        raise ConfigError(f"study.scales={settings.scales}: unknown {unknown}; use some of {sorted(DIMS)}")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    backend = get_backend("reference")
    tables = {"false": backend.implementations(), "true": backend.implementations(batch_invariant=True)}
    device = torch.device(settings.device)
    on_cpu = device.type == "cpu"
    machine = dict(cpu_capability=torch.backends.cpu.get_cpu_capability() if on_cpu else "",
                   threads=torch.get_num_threads() if on_cpu else "")
    rows = []
    print(f"{'scale':5} {'op':32} {'batch_invariant':>15} {'configs':>8} {'differ':>7} {'max |diff|':>11}")
    for scale in settings.scales:
        for name, op, build in cases(DIMS[scale]):
            modes = [("-", op)] if not isinstance(op, str) else [(m, t[op]) for m, t in tables.items()]
            for mode, fn in modes:
                tried, differing, worst = probe(fn, build, SIZES[scale], device)
                print(f"{scale:5} {name:32} {mode:>15} {tried:8d} {differing:7d} {worst:11.3g}")
                rows.append(dict(**machine, scale=scale, op=name, batch_invariant=mode, configs=tried,
                                 differ=differing, max_abs_diff=worst))
    path = write_results(settings.results_path(f"batch_invariance_probe_{device.type}"), rows,
                         study_command("batch_invariance_probe", argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

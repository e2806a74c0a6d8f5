"""How closely the reference backend computes what DeepInfer 0.1.0 computes, op by op.

Each row calls one of our reference functions (``deepinfer/hal``) and one of DeepInfer's own
PyTorch reference functions (from the ``deepinfer`` 0.1.0 and ``tile_kernels`` 2.1.0 sdists) on
the same random inputs and reports the largest absolute difference, the largest relative
difference (against |theirs|, over values at least 1e-3 of the largest), the share of values
(or rows, bytes, tokens, as the note says) that differ, the tolerance the op's OpSpec gives (or
"exact" for integers and bytes), whether the row agrees, and why it may not. Their sources are
imported at run time from the unpacked sdists; nothing of theirs is copied here.

    python experiments/fidelity.py [study.source=DIR] [study.groups=[GROUP,...]] [study.output_dir=DIR]

``DIR`` holds ``deepinfer-0.1.0/`` and ``tile_kernels-2.1.0/`` as unpacked from the sdists;
without it both are fetched from the index pip is configured with (its JSON simple API) into a
temporary folder. ``study.groups`` runs some of the row groups of :data:`GROUPS` (the fast mode
runs three cheap ones). Writes ``experiments/results/fidelity.csv``. Without ``study.source`` it downloads.

Their package is also called ``deepinfer``: it is imported under that name while ours is set
aside (see :func:`fidelity_upstream.load_upstream`), a few imports that need CUDA, the native extension or Python
3.12 are replaced by stubs (:data:`STUBS`), and ``device="cuda"`` in their RoPE table builder is
sent to the CPU (:class:`CpuForCuda`). Rows that use a stub say so.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from deepinfer.config.schema import ConfigError
from deepinfer.results import write_results
from deepinfer.study import StudySettings, compose_study, study_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_compare import COLUMNS, row, tol  # noqa: E402
from fidelity_sampling import sampling_rows  # noqa: E402
from fidelity_upstream import STUBS, CpuForCuda, fetch_sources, load_upstream  # noqa: E402
from deepinfer.hal import formats  # noqa: E402
from deepinfer.hal.ops import activation, compress, grouped_gemm, mhc, norm, rope, routing  # noqa: E402

V41_YARN = {"type": "yarn", "original_max_position_embeddings": 65536, "factor": 16.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": False, "mscale_all_dim": False}


@dataclass
class Settings(StudySettings):
    """Where their sources come from, and which rows run."""

    FAST = ("study.groups=[compress,gate,swiglu]",)
    DOWNLOADS = True

    source: Optional[str] = None
    """Folder with ``deepinfer-0.1.0/`` and ``tile_kernels-2.1.0/`` unpacked; None: fetched from pip's index."""
    groups: list[str] = field(default_factory=list)
    """Row groups of :data:`GROUPS` to run, in that order (empty: every one)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.groups) - set(GROUPS))
        if unknown:
            raise ConfigError(f"study.groups={list(self.groups)!r} names unknown groups {unknown}; "
                              f"use some of {list(GROUPS)}")


def mhc_rows(up, gen) -> list[dict]:
    """Sinkhorn alone, then the whole mixes computation, pre, post and the head."""
    tk, hc, hidden, tokens, iters, eps = up.tk, 4, 4096, 64, 20, 1e-6
    logits = 2 * torch.randn(4096, hc, hc, generator=gen)
    rows = [row("mHC Sinkhorn, 20 iterations", "hal.ops.mhc.sinkhorn", "tile_kernels.torch.sinkhorn_normalize_ref",
                mhc.sinkhorn(logits, eps, iters), tk.sinkhorn_normalize_ref(logits, iters, eps), tol("mhc_mixes"),
                "both (hc_sinkhorn_order=deepinfer, the default): softmax+eps, columns, then (iters-1) x (rows, "
                "columns); column_row (the shipped tiny model's) runs iters x (columns, rows)")]
    residual = torch.randn(tokens, hc, hidden, generator=gen).bfloat16()
    fn = torch.randn(hc * (2 + hc), hc * hidden, generator=gen) / (hc * hidden) ** 0.5
    scale, base = torch.tensor([0.7, 0.9, 1.3]), 0.5 * torch.randn(hc * (2 + hc), generator=gen)
    pre, post, comb = mhc.mhc_mixes(residual, fn, scale, base, eps, eps, iters)
    their_mixes = tk.mhc_pre_norm_fn_ref(residual[None], fn, None, eps)
    t_pre, t_post, t_logits = tk.mhc_pre_split_mixes_ref(their_mixes, scale, base, hc, 2.0, eps)
    theirs = "tile_kernels.torch.mhc_pre_norm_fn_ref + mhc_pre_split_mixes_ref"
    rows.append(row("mHC mixes: pre and post (bf16 residual)", "hal.ops.mhc.mhc_mixes", theirs,
                    torch.cat((pre, post), 1), torch.cat((t_pre, t_post), 2)[0, :, :, 0], tol("mhc_mixes"),
                    "post multiplier 2.0 and eps 1e-6 as V4.1"))
    rows.append(row("mHC mixes: comb (bf16 residual)", "hal.ops.mhc.mhc_mixes",
                    theirs + " + sinkhorn_normalize_ref", comb, tk.sinkhorn_normalize_ref(t_logits, iters, eps)[0],
                    tol("mhc_mixes"), "differs through the Sinkhorn order only"))
    y = torch.randn(tokens, hidden, generator=gen).bfloat16()
    rows.append(row("mHC pre (bf16)", "hal.ops.mhc.mhc_pre", "tile_kernels.torch.mhc_pre_apply_mix_ref",
                    mhc.mhc_pre(residual, pre), tk.mhc_pre_apply_mix_ref(residual, pre[..., None]),
                    tol("mhc_pre", torch.bfloat16)))
    rows.append(row("mHC post (bf16)", "hal.ops.mhc.mhc_post", "tile_kernels.torch.mhc_post_ref",
                    mhc.mhc_post(y, residual, post, comb),
                    tk.mhc_post_ref(y[None], residual[None], post[None, :, :, None], comb[None])[0],
                    tol("mhc_post", torch.bfloat16)))
    head_fn, head_base = fn[:hc], base[:hc]
    rows.append(row("mHC head (bf16 residual)", "hal.ops.mhc.mhc_head",
                    "tile_kernels.torch.mhc_pre_norm_fn_ref + mhc_head_compute_mix_ref",
                    mhc.mhc_head(residual, head_fn, scale[:1], head_base, eps, eps),
                    tk.mhc_head_compute_mix_ref(tk.mhc_pre_norm_fn_ref(residual[None], head_fn, None, eps),
                                                scale[:1], head_base, eps)[0], tol("mhc_head")))
    return rows


def _cache_bytes(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.cat((data.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)), dim=-1)


def _kv_latents(gen, tokens, dim) -> torch.Tensor:
    """bf16 rows over 16 binades, with an all-zero row and a row of tiny values."""
    x = torch.randn(tokens, dim, generator=gen) * torch.exp2(torch.randint(-8, 8, (tokens, 1), generator=gen).float())
    x[0], x[1] = 0.0, 1e-6 * torch.randn(dim, generator=gen)
    return x.bfloat16()


def _fp4_breakdown(ours: torch.Tensor, theirs: torch.Tensor, data_bytes: int, block: int) -> str:
    """Where two packed-e2m1 token rows differ: scale bytes, -0 nibbles, other nibbles (in blocks
    whose scales agree)."""
    def nibbles(b):
        return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)
    our_codes, their_codes = nibbles(ours[:, :data_bytes]), nibbles(theirs[:, :data_bytes])
    scale_differs = ours[:, data_bytes:] != theirs[:, data_bytes:]
    if scale_differs.shape[1] != our_codes.shape[1] // block:  # UE8M0 bytes: one per block
        raise ValueError("scale bytes do not match the blocks")
    negative_zero = (their_codes == 8) & (our_codes == 0)
    other = (our_codes != their_codes) & ~negative_zero & ~scale_differs.repeat_interleave(block, dim=1)
    return (f"scale bytes differ in {scale_differs.double().mean().item():.3%} of blocks; "
            f"{negative_zero.double().mean().item():.3%} of values are -0 (0x8) in theirs, +0 in ours; "
            f"{other.double().mean().item():.3%} of values differ elsewhere in blocks of equal scale")


def quantization_rows(up, gen) -> list[dict]:
    """Cache and activation encodings, byte for byte; max abs diff: the decoded values."""
    tk = up.tk
    x = _kv_latents(gen, 1024, 512)
    theirs = up.cache.ref_cast_from_bf16(x, up.cache.V41_FP4_FORMAT)
    ours, their_bytes = formats.encode_tokens(x, "fp4"), _cache_bytes(theirs.quantized_data, theirs.sf_data)
    decoded = formats.decode_tokens(ours, "fp4") - up.cache.ref_cast_to_bf16(theirs, up.cache.V41_FP4_FORMAT).float()
    rows = [row("FP4 KV cache bytes (288 B/token)", "hal.formats.encode_tokens(fmt='fp4')",
                "cache_common.ref_cast_from_bf16(V41_FP4_FORMAT)", ours, their_bytes, None,
                max_abs=decoded.abs().max().item(),
                note=f"share of bytes; {_fp4_breakdown(ours, their_bytes, 256, 16)}. Both clamp a block's max "
                     f"to 6*2^-9 (scale e4m3(max*(1/6)) >= 2^-9), multiply values by 1/scale (a value exactly half "
                     f"way between two e2m1 steps can round away from the even step) and keep -0 (0x8)")]
    data, scales = tk.cast(x, "e4m3", (1, 32), round_sf=True, use_packed_ue8m0=True)
    ours = formats.encode_tokens(x, "fp8")
    decoded = formats.decode_tokens(ours, "fp8") - tk.cast_back((data, scales), "fp32", (1, 32))
    rows.append(row("FP8 KV cache bytes (528 B/token)", "hal.formats.encode_tokens(fmt='fp8')",
                    "tile_kernels.torch.cast(e4m3, 1x32, round_sf, packed UE8M0)", ours, _cache_bytes(data, scales),
                    None, max_abs=decoded.abs().max().item(),
                    note="share of bytes; their ref_cast_from_bf16 runs the CUDA per_token_cast for this format, "
                         "so its torch reference is called; both clamp a block's max to 1e-4 (zero block: scale "
                         "byte 105), as in the activation rows"))
    index = _kv_latents(gen, 1024, 128)
    data, scales = tk.cast(index, "e2m1", (1, 32), round_sf=True, use_packed_ue8m0=True)
    ours, their_bytes = formats.encode_tokens(index, "index_fp4"), _cache_bytes(data, scales)
    decoded = formats.decode_tokens(ours, "index_fp4") - tk.cast_back((data, scales), "fp32", (1, 32))
    rows.append(row("MXFP4 index K / index Q bytes (68 B/token)", "hal.formats.encode_tokens(fmt='index_fp4')",
                    "tile_kernels.torch.cast(e2m1, 1x32, round_sf, packed UE8M0)", ours, their_bytes, None,
                    max_abs=decoded.abs().max().item(),
                    note=f"share of bytes; {_fp4_breakdown(ours, their_bytes, 64, 32)}; both clamp a block's "
                         f"max to 6*2^-126 (zero block: scale byte 1)"))
    return rows + activation_rows(up, gen)


def activation_rows(up, gen) -> list[dict]:
    """FP8 e4m3 activations with UE8M0 per 32 (the grouped GEMMs' input)."""
    x = torch.randn(256, 4096, generator=gen).bfloat16()
    edge = x.clone().view(256, 128, 32)
    edge[:, 0::3] = 0.0
    edge[:, 1::3] *= 1e-6
    rows = []
    for name, values in (("random activations", x), ("zero and tiny blocks (max < 1e-4)", edge.view(256, 4096))):
        q = formats.quantize(values, "fp8", 32)
        data, scales = up.tk.cast(values, "e4m3", (1, 32), round_sf=True, use_packed_ue8m0=True)
        decoded = q.dequantize() - up.tk.cast_back((data, scales), "fp32", (1, 32))
        rows.append(row(f"FP8 activation quantisation, {name}", "hal.formats.quantize(fmt='fp8', block=32)",
                        "tile_kernels.torch.cast(e4m3, 1x32, round_sf, packed UE8M0)",
                        _cache_bytes(q.data, q.scale), _cache_bytes(data, scales), None,
                        max_abs=decoded.abs().max().item(),
                        note="share of bytes; both clamp a block's max to 1e-4 (zero block: scale 2^-22, "
                             "byte 105), which also sets the tiny blocks' scales"))
    return rows


def rope_rows(up, gen) -> list[dict]:
    """cos/sin tables (theirs: float32 angles and inverse frequencies; ours: float64) and the rotation."""
    rows = []
    with CpuForCuda():
        for name, theta, scaling in (("base, theta 1e4", 10000.0, None), ("YaRN, theta 1.6e5", 160000.0, V41_YARN)):
            yarn = None if scaling is None else rope.YarnScaling(16.0, 65536, 32.0, 1.0)
            for positions in (4096, 65536, 1 << 20):
                theirs = up.rope.get_rope(64, 64, positions, theta, is_neox_style=False,
                                          rope_scaling=scaling).cos_sin_cache
                ours = rope.rope_cos_sin(rope.rope_inv_freq(theta, 64, yarn), positions)
                rows.append(row(f"RoPE table, {name}, {positions} positions", "hal.ops.rope.rope_cos_sin",
                                "rotary_embedding.get_rope(...).cos_sin_cache", ours, theirs, tol("apply_rope"),
                                "theirs: float32 inverse frequencies and float32 angles (position x frequency, "
                                "then polar); ours: float64 angles rounded once to float32; device='cuda' sent to "
                                "the CPU; mscale off as V4.1"))
    table = rope.rope_cos_sin(rope.rope_inv_freq(10000.0), 4096)
    x = torch.randn(64, 8, 64, generator=gen)
    positions = torch.randint(0, 4096, (64,), generator=gen)
    for conjugate in (False, True):
        rows.append(row(f"RoPE rotation, interleaved{', conjugate' if conjugate else ''}", "hal.ops.rope.apply_rope",
                        "tile_kernels.torch.rotary_embedding_ref(interleaved=True)",
                        rope.apply_rope(x, positions, table, conjugate=conjugate),
                        up.tk.rotary_embedding_ref(x, table[:, :32], table[:, 32:], positions, interleaved=True,
                                                   conjugate=conjugate), tol("apply_rope"),
                        "same table; theirs rotates the leading dims, so it gets the 64-dim RoPE slice"))
    return rows


def norm_rows(up, gen) -> list[dict]:
    """RMSNorm with a residual, bf16 (weight bf16, as the checkpoint holds it)."""
    x, residual = (torch.randn(64, 4096, generator=gen).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(4096, generator=gen)).bfloat16()
    normed, summed = norm.rms_norm(x, weight, 1e-6, residual)
    their_normed, their_summed = up.norm.norm_ref(x, weight, 1e-6, residual)
    tk_normed, _, _ = up.tk.norm_forward_ref(x, weight, 1e-6, residual)
    same_sum = (summed == their_summed).double().mean().item()
    return [row("RMSNorm + residual (bf16)", "hal.ops.norm.rms_norm", "tilelang_ops.norm.norm_ref", normed,
                their_normed, tol("rms_norm", torch.bfloat16),
                f"both normalise the bf16-rounded sum; ours scales by the weight in float32 (one rounding), "
                f"theirs rounds, then multiplies by the bf16 weight in bf16; new residual bitwise equal in "
                f"{same_sum:.2%}"),
            row("RMSNorm + residual (bf16)", "hal.ops.norm.rms_norm", "tile_kernels.torch.norm_forward_ref", normed,
                tk_normed, tol("rms_norm", torch.bfloat16),
                "both normalise the bf16-rounded sum, weight in float32, one rounding")]


def compress_rows(up, gen) -> list[dict]:
    """C2 compression at decode and prefill (the state ring read and written by both)."""
    dim, ring, rows = 512, 7, []
    latent, score = torch.randn(11, dim, generator=gen), 2 * torch.randn(11, dim, generator=gen)
    state = torch.randn(4, ring, 2, dim, generator=gen)
    decode_slots, decode_positions = torch.arange(4), torch.tensor([5, 8, 3, 10])
    our_state, their_state = state.clone(), state.clone()
    ours, emit = compress.compress_tokens(latent[:4], score[:4], decode_positions, decode_slots, decode_positions,
                                          our_state, 2)
    theirs = up.compress.compress_and_update_state_decode_ref(score[:4], latent[:4], their_state, decode_slots.int(),
                                                              (decode_positions + 1).int(), 1, 2)
    rows.append(row("compress_tokens C2 decode: output", "hal.ops.compress.compress_tokens",
                    "compress.compress_and_update_state_decode_ref", ours, theirs, tol("compress_tokens"),
                    f"both bf16 (pooled in float32, one rounding); state rings bitwise equal: "
                    f"{torch.equal(our_state, their_state)}"))
    our_state, their_state = state.clone(), state.clone()
    positions = torch.cat((torch.arange(3, 9), torch.arange(0, 5)))
    slots, starts = torch.tensor([2] * 6 + [0] * 5), torch.tensor([3] * 6 + [0] * 5)
    ours, emit = compress.compress_tokens(latent, score, positions, slots, starts, our_state, 2)
    seqlen_q, seqlen_k = torch.tensor([6, 5]), torch.tensor([9, 5])
    cu_compressed, mapping = up.compress._make_compressed_meta(seqlen_q, seqlen_k, 2)
    theirs = up.compress.compress_and_update_state_prefill_ref(
        score, latent, their_state, torch.tensor([2, 0], dtype=torch.int32), mapping,
        up.compress._get_cuseqlen(seqlen_q), up.compress._get_cuseqlen(seqlen_k), cu_compressed, 2)
    rows.append(row("compress_tokens C2 prefill (group split across calls): output", "hal.ops.compress.compress_tokens",
                    "compress.compress_and_update_state_prefill_ref", ours[emit], theirs, tol("compress_tokens"),
                    f"both bf16; state rings bitwise equal: {torch.equal(our_state, their_state)}"))
    return rows


def gate_rows(up, gen) -> list[dict]:
    """sqrt-softplus MoE gate with the noaux_tc bias, 384 experts, top 6, routed scale 1.5."""
    rows, bias = [], 0.1 * torch.randn(384, generator=gen)
    for name, logits, use_bias in (("random", 2 * torch.randn(256, 384, generator=gen), bias),
                                   ("tied (integer, no bias)", torch.randint(-1, 2, (256, 384), generator=gen).float(),
                                    None)):
        weights, ids = routing.moe_gate(logits, use_bias, 6, 1.5)
        their_ids, their_weights = up.tk.moe_topk_gate_forward(logits, 6, False, 0, 1.5, 0, "sqrtsoftplus",
                                                               bias=use_bias)
        result = row(f"MoE gate, {name} logits", "hal.ops.routing.moe_gate", "tile_kernels.torch.moe_topk_gate_forward",
                     weights, their_weights, tol("moe_gate"), "mismatch share: expert ids; max diffs: routed weights")
        id_share = (ids != their_ids).double().mean().item()
        rows.append({**result, "mismatch_share": f"{id_share:.4g}", "agrees": result["agrees"] and id_share == 0})
    return rows


def swiglu_row(up, gen) -> dict:
    gate, value = (8 * torch.randn(64, 2048, generator=gen) for _ in range(2))
    return row("clamped SwiGLU (limit 10)", "hal.ops.activation.swiglu", "tile_kernels.torch.swiglu_forward",
               activation.swiglu(gate, value, 10.0), up.tk.swiglu_forward(torch.cat((gate, value), 1), clamp_value=10.0),
               tol("swiglu"))


def logits_row(up, gen) -> dict:
    """LM head of a bf16 model: both a bf16 GEMM written to float32."""
    hidden = torch.randn(64, 4096, generator=gen).bfloat16()
    weight = (torch.randn(129280, 4096, generator=gen) * 0.05).bfloat16()
    ours = grouped_gemm.linear(hidden, weight, out_dtype=torch.float32)
    theirs = up.logits.get_logits(hidden, weight, 129280)
    flips = (ours.argmax(dim=1) != theirs.argmax(dim=1)).double().mean().item()
    ties = ((ours == ours.max(dim=1, keepdim=True).values).sum(dim=1) > 1).double().mean().item()
    return row("LM head logits (bf16 model)", "models/deepseek_v41/model.py: head (hal linear, out_dtype=float32)",
               "sampler_utils.get_logits (float32 output)", ours, theirs, tol("linear"),
               f"deep_gemm stubbed ({STUBS['deep_gemm']}); both write the float32 accumulator: greedy token differs "
               f"in {flips:.1%} of rows, {ties:.1%} of rows have a tied maximum")


NOT_COMPARED = (
    ("indexer logits", "hal.ops.indexer.indexer_logits", "deep_gemm.fp8_fp4_mqa_logits", "a DeepGEMM kernel"),
    ("indexer top-k", "hal.ops.indexer.indexer_topk", "deep_select.interface.topk", "a deep_select kernel"),
    ("sparse MLA", "hal.ops.mla.mla_sparse_prefill / mla_sparse_decode", "flash_mla", "FlashMLA kernels"),
    ("grouped GEMM", "hal.ops.grouped_gemm.grouped_gemm", "deep_gemm.m_grouped_*", "DeepGEMM kernels"),
    ("kv norm + RoPE + cast + store", "hal.ops.kv_norm_rope_store.kv_norm_rope_store",
     "fused_transform.fused_norm_rope_hadamard_cast_store_kvcache_ref", "CUDA norm and apply_rotary kernels called "
     "by their reference (its parts are the RMSNorm, RoPE and cache-bytes rows)"),
)
"""Ops whose DeepInfer side runs only as CUDA code: (item, ours, theirs, what it runs)."""


def not_compared_rows(up, gen) -> list[dict]:
    """The ops of :data:`NOT_COMPARED`, each a row that says why."""
    return [{"item": item, "our_function": ours, "their_function": theirs, "agrees": "",
             "note": f"not compared: no PyTorch reference in the two sdists, only {what}"}
            for item, ours, theirs, what in NOT_COMPARED]


GROUPS = {"mhc": mhc_rows, "sampling": sampling_rows, "quantization": quantization_rows, "rope": rope_rows,
          "norm": norm_rows, "compress": compress_rows, "gate": gate_rows,
          "swiglu": lambda up, gen: [swiglu_row(up, gen)], "logits": lambda up, gen: [logits_row(up, gen)],
          "not_compared": not_compared_rows}
"""Row groups by name, in the order they run: each takes their modules and the shared generator."""


def run(source: Path, groups: list[str]) -> list[dict]:
    """The rows of ``groups`` (every group when empty), their modules imported from ``source``."""
    up = load_upstream(source)
    gen = torch.Generator().manual_seed(29)
    return [r for name, rows in GROUPS.items() if not groups or name in groups for r in rows(up, gen)]


def main(argv=None) -> int:
    app, settings = compose_study("fidelity", Settings, argv)
    with tempfile.TemporaryDirectory() as scratch:
        rows = run(Path(settings.source) if settings.source else fetch_sources(Path(scratch)), settings.groups)
    for r in rows:
        print(f"{str(r['agrees']):<5} {r['item']:<64} abs {r.get('max_abs_diff', ''):>9} "
              f"share {r.get('mismatch_share', ''):>8}  {r['note'][:90]}")
    path = write_results(settings.results_path("fidelity"), [{column: r.get(column, "") for column in COLUMNS}
                                                             for r in rows], study_command("fidelity", argv))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

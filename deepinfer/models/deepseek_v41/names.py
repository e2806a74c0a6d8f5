"""Checkpoint tensor names and the storage format of each (official V4.1 layout, Appendix B)."""
from __future__ import annotations

import re

FP8_SUFFIXES = (
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight", "main_proj.weight", "engram.wkv.weight",
)
ROW_FP8_SUFFIXES = ("engram.embed.weight",)
"""Engram tables: FP8 rows with a UE8M0 scale per 32 values of each row."""
FP32_PATTERNS = (
    r"(^|\.)hc_(attn|ffn|head)_(base|fn|scale)$", r"\.attn\.attn_sink$", r"\.ffn\.gate\.bias(_vl)?$",
)
EXPERT_PATTERN = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def strip_prefix(name: str) -> str:
    """Drop the optional ``model.`` prefix of official checkpoints."""
    return name[len("model."):] if name.startswith("model.") else name


def storage_format(name: str) -> str:
    """How tensor ``name`` is stored: ``"fp8"`` (e4m3 + 32x32 UE8M0 ``.scale``), ``"fp8_rows"``
    (e4m3 + UE8M0 ``.scale`` per 32 values of a row), ``"mxfp4"`` (packed e2m1 + per-32 UE8M0
    ``.scale``), ``"fp32"`` or ``"bf16"``."""
    name = strip_prefix(name)
    if EXPERT_PATTERN.search(name):
        return "mxfp4"
    if name.endswith(ROW_FP8_SUFFIXES):
        return "fp8_rows"
    if name.endswith(FP8_SUFFIXES):
        return "fp8"
    if any(re.search(p, name) for p in FP32_PATTERNS):
        return "fp32"
    return "bf16"

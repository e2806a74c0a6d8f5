"""The ascend950 tilelang-ascend kernels lowered to pto/A5 agree with the emulation's plan
(block counts, tile rounds, buffer offsets, sizes and tile shapes), checked by
``experiments/ascend_lower.py``'s own check, lowering in this interpreter. Runs only where tilelang-ascend
imports (an aarch64 CPython 3.11 with its wheel); elsewhere it skips, never starting an emulator."""
import importlib
import importlib.metadata
import sys

import pytest

from deepinfer.study import load_script


def _tilelang_ascend_reason() -> str | None:
    try:
        importlib.metadata.distribution("tilelang-ascend")
    except importlib.metadata.PackageNotFoundError:
        return ("tilelang-ascend is not installed here (it ships only as an aarch64 CPython 3.11 wheel; "
                "experiments/ascend_lower_setup.sh builds an interpreter for it under qemu-user-static)")
    try:
        import tilelang.language as T
    except Exception as error:  # a broken install is a reason to skip, with its message
        return f"tilelang does not import: {type(error).__name__}: {error}"
    if not hasattr(T, "alloc_ub"):
        return "the tilelang that imports here is not tilelang-ascend's (no T.alloc_ub)"
    return None


REASON = _tilelang_ascend_reason()


@pytest.mark.skipif(REASON is not None, reason=str(REASON))
def test_every_kernel_lowers_to_pto_a5_as_its_plan_says():
    rows, _ = load_script("ascend_lower").check(None, "pto", "A5")
    wrong = [r for r in rows if r["status"] not in ("agrees", "merged")]
    assert not wrong, "\n".join(f"{r['kernel']} {r['check']}: plan {r['plan']}, lowered {r['lowered']} ({r['status']})"
                                for r in wrong)


def test_the_plan_expectations_build_without_tilelang():
    study = load_script("ascend_lower")
    rows = [r for case in study.cases() for r in study.compare(case, None)]
    assert {r["kernel"] for r in rows} >= {"rms_norm_bf16_d1024", "grouped_gemm_bfloat16", "mla_sparse_decode_bf16",
                                           "apply_rope_bf16_h64", "kv_norm_rope_store_bf16", "kv_norm_rope_store_fp8",
                                           "kv_norm_rope_store_index_fp4", "kv_norm_rope_store_fp4",
                                           "mla_sparse_decode_fp8", "mla_sparse_decode_fp8_fp4",
                                           "mla_sparse_prefill_bf16"}
    assert all(r["status"] == "not lowered" for r in rows)


class _NoTilelang:
    """A meta-path finder that refuses ``tilelang`` and its submodules."""

    def find_spec(self, name, path=None, target=None):
        if name == "tilelang" or name.startswith("tilelang."):
            raise ImportError(f"{name} is blocked: the kernel modules must import it only inside their builders")
        return None


def test_the_kernel_modules_import_without_tilelang(monkeypatch):
    for name in [n for n in sys.modules if n == "tilelang" or n.startswith(("tilelang.",
                                                                            "deepinfer_backends.ascend950.kernels"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoTilelang(), *sys.meta_path])
    for module in ("rms_norm", "grouped_gemm", "grouped_gemm_fp8", "mla_sparse_decode", "mla_sparse_prefill",
                   "apply_rope", "kv_norm_rope_store"):
        assert callable(getattr(importlib.import_module(f"deepinfer_backends.ascend950.kernels.{module}"),
                                f"{module}_kernel"))

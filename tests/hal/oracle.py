"""Helpers for float64 oracles: run an op case's inputs at float64 and compare."""
from __future__ import annotations

import torch

from deepinfer.hal.spec import SPECS, compare


def as_float64(value):
    """Floating tensors to float64 (other values untouched), recursively."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        if value.dtype in (torch.float8_e4m3fn,):
            return value
        return value.double()
    if isinstance(value, (list, tuple)):
        return type(value)(as_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: as_float64(v) for k, v in value.items()}
    return value


def check_against_oracle(op: str, case_name: str, oracle, seed: int = 0):
    """Run ``op``'s reference on a case and compare it with ``oracle(**float64 inputs)``."""
    spec = SPECS[op]
    case = spec.case(case_name)
    inputs = case.make_inputs(torch.Generator().manual_seed(seed), torch.device("cpu"))
    want = oracle(**as_float64(_clone(inputs)))
    got = spec.reference(**_clone(inputs))
    failures = compare(got, _cast_like(want, got), spec.case_tolerance(case), f"{op}[{case_name}]")
    assert not failures, "\n".join(failures)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _cast_like(want, got):
    if isinstance(want, (list, tuple)):
        return type(want)(_cast_like(w, g) for w, g in zip(want, got))
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.is_floating_point():
        return want.to(got.dtype) if got.dtype == torch.bfloat16 else want
    return want

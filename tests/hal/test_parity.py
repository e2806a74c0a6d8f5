"""The parity grid: every op x every installed backend x every case, against the reference run
on the CPU. The reference itself is in the grid when it can run on a GPU (its fallback role);
on a CPU-only machine with only the reference installed the grid is empty and skips. A case whose
dtype a backend does not declare (``capabilities.dtypes``) is skipped with that reason, unless the op
takes no activations (``OpSpec.activations``)."""
import dataclasses

import pytest
import torch

from deepinfer.hal import SPECS, available_backends, get_backend
from deepinfer.hal.spec import compare, dtype_skip_reason
from tests.hal.oracle import _clone


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: _to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **moved)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _device_for(backend: str) -> torch.device | None:
    caps = get_backend(backend).capabilities
    if "cuda" in caps.device_types and torch.cuda.is_available():
        return torch.device("cuda")
    if "cpu" in caps.device_types and backend != "reference":
        return torch.device("cpu")
    return None


def _grid():
    for backend in sorted(available_backends()):
        if _device_for(backend) is None:
            continue
        for op, spec in sorted(SPECS.items()):
            for case in spec.cases:
                yield pytest.param(backend, op, case.name, id=f"{backend}-{op}-{case.name}")


@pytest.mark.parametrize("backend,op,case", list(_grid()))
def test_backend_matches_reference(backend, op, case):
    device = _device_for(backend)
    impl = get_backend(backend).implementations().get(op)
    if impl is None:
        pytest.skip(f"backend {backend!r} declares {op!r} unsupported")
    spec = SPECS[op]
    c = spec.case(case)
    reason = dtype_skip_reason(spec, c, get_backend(backend).capabilities.dtypes)
    if reason:
        pytest.skip(f"{backend}: {reason}")
    inputs = c.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    want = spec.reference(**_clone(inputs))
    got = impl(**_to_device(_clone(inputs), device))
    failures = compare(got, want, spec.case_tolerance(c), f"{backend}/{op}/{case}")
    assert not failures, "\n".join(failures)

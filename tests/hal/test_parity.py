"""The parity grid (:mod:`deepinfer.hal.parity`): every op x every installed backend x every case,
against the reference run on the CPU, plus every op x case of the reference's batch-invariant
table against its plain one (on the CPU, so CI always swaps a backend). The reference itself is
in the first grid when it can run on a GPU (its fallback role); a backend with a CPU emulation
(ascend950) runs emulated. A case whose dtype a backend does
not declare (``capabilities.dtypes``) is skipped with that reason, unless the op takes no
activations (``OpSpec.activations``)."""
import dataclasses

import pytest
import torch

from deepinfer.hal import SPECS, available_backends, get_backend
from deepinfer.hal.parity import Side, run_case

EXPECTATION = Side("reference", device=torch.device("cpu"))


def _device_for(backend: str) -> torch.device | None:
    caps = get_backend(backend).capabilities
    if "cuda" in caps.device_types and torch.cuda.is_available():
        return torch.device("cuda")
    if "cpu" in caps.device_types and backend != "reference":
        return torch.device("cpu")
    return None


def _side(backend: str) -> Side:
    """``backend`` where it runs here; a backend with a CPU emulation (an ``execution`` option)
    runs emulated."""
    options_type = type(get_backend(backend)).options_type
    emulates = options_type is not None and "execution" in {f.name for f in dataclasses.fields(options_type)}
    return Side(backend, device=_device_for(backend), options={"execution": "emulate"} if emulates else None)


def _grid():
    for backend in sorted(available_backends()):
        if _device_for(backend) is None:
            continue
        for op, spec in sorted(SPECS.items()):
            for case in spec.cases:
                yield pytest.param(backend, op, case.name, id=f"{backend}-{op}-{case.name}")


def _check(row) -> None:
    if row.status == "skip":
        pytest.skip(row.detail)
    assert row.status == "pass", f"{row.detail} (max error {row.max_error:.3g}, mean {row.mean_error:.3g})"


@pytest.mark.parametrize("backend,op,case", list(_grid()))
def test_backend_matches_reference(backend, op, case):
    spec = SPECS[op]
    _check(run_case(EXPECTATION, _side(backend), spec, spec.case(case)))


@pytest.mark.parametrize("op,case", [pytest.param(op, case.name, id=f"{op}-{case.name}")
                                     for op, spec in sorted(SPECS.items()) for case in spec.cases])
def test_batch_invariant_reference_matches_reference(op, case):
    spec = SPECS[op]
    _check(run_case(EXPECTATION, Side("reference", batch_invariant=True, device=torch.device("cpu")), spec,
                    spec.case(case)))

"""A kernel module's own check on this GPU: every case of its op's OpSpec through the sm100 op
table, against the HAL reference (on the CPU) within the spec's tolerance. Each kernel module's
``main()`` runs it for the ops it serves (``python -m deepinfer_backends.sm100.kernels.<module>``)."""
from __future__ import annotations

import dataclasses
import sys

import torch


def _moved(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value


def check_op(op: str, options: dict | None = None) -> bool:
    """Every case of ``op`` whose dtype the sm100 backend takes, with kernel ``options``
    (``backend.options``); prints a line per case, returns whether all passed."""
    import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)
    from deepinfer.hal.registry import get_backend
    from deepinfer.hal.spec import SPECS, compare, dtype_skip_reason

    backend, spec = get_backend("sm100", options), SPECS[op]
    impl, passed = backend.implementations()[op], True
    for case in spec.cases:
        if dtype_skip_reason(spec, case, backend.capabilities.dtypes):
            continue
        inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
        want = spec.reference(**_moved(inputs, torch.device("cpu")))
        try:
            failures = compare(impl(**_moved(inputs, torch.device("cuda"))), want, spec.case_tolerance(case),
                               f"{op}/{case.name}")
        except Exception as error:  # reported with the case, the other cases still run
            failures = [f"{type(error).__name__}: {error}"]
        passed = passed and not failures
        print(f"{op}/{case.name} {options or {}}: {'pass' if not failures else 'FAIL ' + '; '.join(failures)[:300]}",
              flush=True)
    return passed


def run(*ops: str, **options) -> None:
    """:func:`check_op` for each of ``ops``; exits 1 if any case failed."""
    results = [check_op(op, options or None) for op in ops]
    sys.exit(0 if all(results) else 1)

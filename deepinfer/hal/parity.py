"""The parity grid: every op x case of the op table run on two backends (each in its plain or
batch-invariant table, on the device it declares) and compared within the op's tolerance for the
case, the first side taken as the expectation. ``tests/hal/test_parity.py`` runs it against the
reference for every installed backend; ``python -m deepinfer task=parity`` prints and records it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from deepinfer.hal.backend import UnsupportedInput
from deepinfer.hal.registry import get_backend
from deepinfer.hal.spec import SPECS, OpCase, OpSpec, Tolerance, compare, dtype_skip_reason


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a backend (with its ``options``, ``backend.options`` and
    ``execution``), its batch-invariant table or not, and the device it runs on
    (:func:`side_device` when None; the CPU for an emulation)."""

    backend: str
    batch_invariant: bool = False
    device: torch.device | None = None
    options: dict | None = None

    @property
    def emulated(self) -> bool:
        return (self.options or {}).get("execution") == "emulate"

    @property
    def label(self) -> str:
        return (f"{self.backend}{' (batch-invariant)' if self.batch_invariant else ''}"
                f"{' (emulated)' if self.emulated else ''}")

    def implementations(self) -> dict:
        backend = get_backend(self.backend, self.options)
        if not self.batch_invariant:
            return backend.implementations()
        if not backend.capabilities.batch_invariant:
            raise ValueError(f"backend {self.backend!r} does not declare batch invariance; compare its plain table")
        return backend.implementations(batch_invariant=True)

    def on_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        return torch.device("cpu") if self.emulated else side_device(self.backend)


@dataclass(frozen=True)
class ParityRow:
    """One op x case: ``status`` pass, fail or skip (``detail`` says why, or what failed); the
    largest and mean absolute error of every floating output, the largest error as a share of
    its tolerance (``tolerance_used``: above 1 fails), the share of values out of tolerance, and
    the integer values that differ."""

    op: str
    case: str
    size: str
    status: str
    max_error: float = 0.0
    mean_error: float = 0.0
    tolerance_used: float = 0.0
    out_of_tolerance: float = 0.0
    integers_differing: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    detail: str = ""


def side_device(backend: str) -> torch.device:
    """Where ``backend`` runs here: CUDA when it declares CUDA and a GPU is present, else the CPU
    when it declares the CPU; an error naming its device types otherwise."""
    types = get_backend(backend).capabilities.device_types
    if "cuda" in types and torch.cuda.is_available():
        return torch.device("cuda")
    if "cpu" in types:
        return torch.device("cpu")
    raise RuntimeError(f"backend {backend!r} runs on {sorted(types)}, none of which this machine has")


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside it (dataclasses, dicts, sequences) copied to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.clone().to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def error_stats(got: Any, want: Any, tol: Tolerance) -> tuple[float, float, float, float, int]:
    """``(max abs error, mean abs error, largest error / its bound, share of values out of
    tolerance, integers differing)`` over every tensor of the nested outputs ``got`` and ``want``
    (same structure); the bound of a value is ``atol + rtol * |want|``."""
    pairs = list(_tensor_pairs(got, want))
    floats = [(g.detach().cpu().double(), w.detach().cpu().double()) for g, w in pairs
              if w.is_floating_point() and g.shape == w.shape]
    integers = sum(int((g.cpu() != w.cpu()).sum()) for g, w in pairs if not w.is_floating_point() and g.shape == w.shape)
    if not floats:
        return 0.0, 0.0, 0.0, 0.0, integers
    errors, used, bad, total = [], 0.0, 0, 0
    for g, w in floats:
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        err = (g - w).abs().masked_fill(same, 0.0)
        bound = tol.atol + tol.rtol * w.abs().masked_fill(same, 0.0)
        errors.append(err[torch.isfinite(err)].flatten())
        ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
        used = max(used, float(ratio.max()) if ratio.numel() else 0.0)
        bad += int((~(err <= bound)).sum())
        total += w.numel()
    flat = torch.cat(errors)
    if not total:
        return 0.0, 0.0, 0.0, 0.0, integers
    if not flat.numel():
        return float("inf"), float("inf"), used, bad / max(total, 1), integers
    return float(flat.max()), float(flat.mean()), used, bad / max(total, 1), integers


def _tensor_pairs(got: Any, want: Any) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        yield got, want
    elif isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        for g, w in zip(got, want):
            yield from _tensor_pairs(g, w)
    elif dataclasses.is_dataclass(want) and not isinstance(want, type):
        for f in dataclasses.fields(want):
            yield from _tensor_pairs(getattr(got, f.name, None), getattr(want, f.name))


def run_case(a: Side, b: Side, spec: OpSpec, case: OpCase, seed: int = 0) -> ParityRow:
    """``spec``'s ``case`` on both sides, from the same inputs (made on the CPU with ``seed``),
    ``b`` compared with ``a``."""
    tol = spec.case_tolerance(case)
    row = dict(op=spec.name, case=case.name, size=case.size, atol=tol.atol, rtol=tol.rtol)
    impls = []
    for side in (a, b):
        impl = side.implementations().get(spec.name)
        reason = dtype_skip_reason(spec, case, get_backend(side.backend, side.options).capabilities.dtypes)
        if impl is None or reason:
            return ParityRow(**row, status="skip", detail=f"{side.label}: {reason or 'does not implement the op'}")
        impls.append(impl)
    inputs = case.make_inputs(torch.Generator().manual_seed(seed), torch.device("cpu"))
    outputs = []
    for side, impl in zip((a, b), impls):
        try:
            outputs.append(impl(**to_device(inputs, side.on_device())))
        except UnsupportedInput as error:
            return ParityRow(**row, status="skip", detail=f"{side.label}: {error}")
    want, got = outputs
    failures = compare(got, want, tol, f"{spec.name}/{case.name}")
    max_error, mean_error, used, share, integers = error_stats(got, want, tol)
    return ParityRow(**row, status="fail" if failures else "pass", max_error=max_error, mean_error=mean_error,
                     tolerance_used=used, out_of_tolerance=share, integers_differing=integers,
                     detail="; ".join(failures))


def parity_grid(a: Side, b: Side, ops: Iterable[str] | None = None, sizes: Iterable[str] | None = None,
                seed: int = 0) -> list[ParityRow]:
    """:func:`run_case` for every case (of the ``sizes`` given, default all) of every op (of
    ``ops``, default the whole table, in name order)."""
    import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)

    names = sorted(SPECS) if not ops else list(ops)
    unknown = [name for name in names if name not in SPECS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known ops: {sorted(SPECS)}")
    wanted = set(sizes) if sizes else None
    return [run_case(a, b, SPECS[name], case, seed) for name in names for case in SPECS[name].cases
            if wanted is None or case.size in wanted]

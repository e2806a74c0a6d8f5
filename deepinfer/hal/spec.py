"""OpSpec: an op's contract as data (reference function, named cases, tolerances)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Tolerance:
    """Allowed deviation: ``|got - want| <= atol + rtol * |want|`` elementwise."""

    atol: float
    rtol: float


DEFAULT_TOLERANCES = {
    torch.float64: Tolerance(1e-9, 1e-9),
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.bfloat16: Tolerance(2e-2, 2e-2),
}
FLOAT32_OUTPUT = DEFAULT_TOLERANCES[torch.float32]  # a case whose result is float32 from inputs of another dtype


@dataclass(frozen=True)
class OpCase:
    """A named input set for an op.

    ``make_inputs(generator, device)`` returns the keyword arguments of one call. ``size`` is
    ``"tiny"`` (seconds on a CPU) or ``"real"`` (V4.1 shapes, may be reduced in count but not in
    per-row dims). ``dtype`` is the activations' dtype, which picks the backends that run the case
    and, unless ``tolerance`` is given, the tolerance (:meth:`OpSpec.case_tolerance`)."""

    name: str
    make_inputs: Callable[[torch.Generator, torch.device], dict[str, Any]]
    size: str = "tiny"
    dtype: torch.dtype = torch.float32
    tolerance: Tolerance | None = None


@dataclass(frozen=True)
class OpSpec:
    """Contract of one HAL op.

    ``reference`` is the PyTorch ground truth (float32 accumulation, any device). Backends must
    match it within ``tolerance(dtype)`` on every case; integer outputs must match exactly.
    ``activations``: whether the op takes activations in the model's dtype, so that a backend
    runs only the cases whose ``dtype`` it declares (``Capabilities.dtypes``); ops whose inputs
    are indices or have a fixed float dtype (float32 logits, router logits) set it False, and
    every backend runs all their cases."""

    name: str
    summary: str
    reference: Callable[..., Any]
    cases: tuple[OpCase, ...]
    tolerances: dict[torch.dtype, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    activations: bool = True

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, DEFAULT_TOLERANCES.get(dtype, Tolerance(1e-4, 1e-4)))

    def case_tolerance(self, case: OpCase) -> Tolerance:
        """The case's own tolerance, else the op's for the case's dtype."""
        return case.tolerance or self.tolerance(case.dtype)

    def case(self, name: str) -> OpCase:
        for case in self.cases:
            if case.name == name:
                return case
        raise KeyError(f"op {self.name!r} has no case {name!r}; cases: {[c.name for c in self.cases]}")


SPECS: dict[str, OpSpec] = {}


def dtype_skip_reason(spec: OpSpec, case: OpCase, dtypes: frozenset[torch.dtype]) -> str | None:
    """Why a backend with activation ``dtypes`` does not run ``case`` of ``spec`` (None: it runs it)."""
    if not spec.activations or case.dtype in dtypes:
        return None
    return f"the backend declares activation dtypes {sorted(map(str, dtypes))}; case {case.name!r} runs {case.dtype}"


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the op table; op names are unique."""
    if spec.name in SPECS:
        raise ValueError(f"op {spec.name!r} is declared twice")
    SPECS[spec.name] = spec
    return spec


def compare(got: Any, want: Any, tol: Tolerance, where: str = "output") -> list[str]:
    """Compare nested outputs; returns failure messages with max and mean error (empty: equal)."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return [f"{where}: expected a sequence of {len(want)} outputs, got {type(got).__name__}"]
        failures = []
        for i, (g, w) in enumerate(zip(got, want)):
            failures += compare(g, w, tol, f"{where}[{i}]")
        return failures
    if want is None:
        return [] if got is None else [f"{where}: expected None"]
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        failures = []
        for f in dataclasses.fields(want):
            value = getattr(want, f.name)
            if isinstance(value, (torch.Tensor, int, float, str, tuple, list)) or dataclasses.is_dataclass(value):
                failures += compare(getattr(got, f.name), value, tol, f"{where}.{f.name}")
        return failures
    if not isinstance(want, torch.Tensor):
        return [] if got == want else [f"{where}: expected {want!r}, got {got!r}"]
    if got.shape != want.shape:
        return [f"{where}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"]
    got, want = got.detach().cpu(), want.detach().cpu()
    if not want.is_floating_point():
        mismatched = (got != want).sum().item()
        return [f"{where}: {mismatched} of {want.numel()} integer values differ"] if mismatched else []
    g, w = got.double(), want.double()
    both_inf = torch.isinf(w) & (g == w)
    nan_ok = torch.isnan(w) & torch.isnan(g)
    err = (g - w).abs().masked_fill(both_inf | nan_ok, 0.0)
    bound = tol.atol + tol.rtol * w.abs().masked_fill(both_inf | nan_ok, 0.0)
    bad = ~(err <= bound)
    if bad.any():
        finite = err[torch.isfinite(err)]
        return [f"{where}: {bad.sum().item()} of {w.numel()} values out of tolerance "
                f"(atol={tol.atol}, rtol={tol.rtol}); max err {finite.max().item() if finite.numel() else 'inf'}, "
                f"mean err {finite.mean().item() if finite.numel() else 'inf'}"]
    return []

"""The comparison behind every row of :mod:`fidelity`: ours against theirs, exactly or within
the tolerance our OpSpec gives, as one CSV row."""
from __future__ import annotations

import torch

from deepinfer.hal import SPECS, Tolerance

COLUMNS = ("item", "our_function", "their_function", "max_abs_diff", "max_rel_diff", "mismatch_share", "tolerance",
           "agrees", "note")
"""A row's columns, in the CSV's order."""
EXACT = "exact"


def row(item, ours, theirs, got, want, tolerance: Tolerance | None, note="", per_row=False, max_abs=None) -> dict:
    """One CSV row comparing ``got`` (ours) with ``want`` (theirs). With a tolerance: values agree
    when ``|got - want| <= atol + rtol * |want|`` (infinities must match); without: exactly.
    ``per_row``: the mismatch share counts rows of ``want`` with any differing value."""
    g, w = got.detach().cpu(), want.detach().cpu()
    if tolerance is None:
        bad = g != w
    else:
        g, w = g.double(), w.double()
        same = g == w
        err = (g - w).abs().masked_fill(same, 0.0)
        bad = ~(err <= tolerance.atol + tolerance.rtol * w.abs().masked_fill(same, 0.0))
        large = w.abs() >= 1e-3 * w.abs().masked_fill(~torch.isfinite(w), 0).max()
        relative = (err / w.abs())[large & torch.isfinite(w) & ~same]
        max_abs = err[torch.isfinite(err)].max().item() if max_abs is None else max_abs
        note = f"{(~same).double().mean().item():.2%} of values not bitwise equal; {note}".rstrip("; ")
    share = (bad.reshape(bad.shape[0], -1).any(dim=1) if per_row else bad).double().mean().item()
    return {"item": item, "our_function": ours, "their_function": theirs,
            "max_abs_diff": "" if max_abs is None else f"{max_abs:.3g}",
            "max_rel_diff": f"{relative.max().item():.3g}" if tolerance is not None and relative.numel() else "",
            "mismatch_share": f"{share:.4g}", "agrees": share == 0,
            "tolerance": EXACT if tolerance is None else f"atol {tolerance.atol:g}, rtol {tolerance.rtol:g}",
            "note": note}


def tol(op: str, dtype=torch.float32) -> Tolerance:
    """The tolerance our OpSpec ``op`` gives ``dtype``."""
    return SPECS[op].tolerance(dtype)

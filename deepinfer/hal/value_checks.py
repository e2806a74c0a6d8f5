"""Input checks that read tensor values, and the switch that skips them inside an engine step.

An op's contract has two kinds of checks: shapes, dtypes and formats (free, always on) and
value ranges (an index inside the cache, a position inside the RoPE table). Reading a value
on the host costs a device synchronisation on an accelerator, and a captured CUDA graph cannot
hold one, so the engine runs its forward under :func:`skip_value_checks` after validating the
inputs once on the host. Called directly (tests, notebooks), every op checks its values."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_ENABLED = contextvars.ContextVar("deepinfer_value_checks", default=True)


def value_checks() -> bool:
    """Whether ops should run their value checks (False inside :func:`skip_value_checks`)."""
    return _ENABLED.get()


@contextlib.contextmanager
def skip_value_checks() -> Iterator[None]:
    """Inside, ops skip every check that reads a tensor value on the host."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)

"""Backend base class and the capabilities record every backend declares."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

import torch


class UnsupportedInput(ValueError):
    """A backend implements the op but not for these inputs (dtype, format, shape); the message
    says which and what to do. With ``backend.fallback`` configured, the op table runs the
    fallback's implementation for such calls instead (logged once per op)."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared rather than sniffed.

    ``device_types``: torch device types it runs on. ``dtypes``: activation dtypes. ``fp8`` /
    ``fp4``: native quantized formats. ``batch_invariant``: on request
    (``implementations(batch_invariant=True)``) every op computes each row with a reduction
    order independent of the batch, on every device type listed. ``collectives``:
    torch.distributed backends its EP ops use. ``notes``: plain-language caveats (e.g.
    "compiled, not run on hardware")."""

    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    fp8: bool = False
    fp4: bool = False
    batch_invariant: bool = False
    collectives: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()


class Backend:
    """A set of op implementations for one kind of hardware.

    Subclasses set ``name`` (one lowercase token) and ``capabilities`` and return their ops from
    :meth:`implementations`; a backend with kernel choices sets ``options_type`` (a dataclass)
    and reads ``self.options``. They are found through the ``deepinfer.backends`` entry-point group.
    A backend declaring ``batch_invariant`` must accept ``implementations(batch_invariant=True)``
    (checked when the subclass is defined)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    options_type: ClassVar[type | None] = None
    """The dataclass of this backend's options (``backend.options``), or None when it has none."""

    def __init__(self, options: Mapping[str, Any] | None = None):
        """``options``: ``backend.options`` for this backend, checked by :attr:`options_type`."""
        if options and self.options_type is None:
            raise ValueError(f"backend {self.name!r} takes no options; got backend.options={dict(options)}")
        if self.options_type is None:
            self.options = None
            return
        known = {f.name for f in fields(self.options_type)}
        unknown = sorted(set(options or {}) - known)
        if unknown:
            raise ValueError(f"backend {self.name!r} has no options {unknown}; its options: {sorted(known)}")
        self.options = self.options_type(**dict(options or {}))

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
            raise TypeError(f"backend class {cls.__qualname__} needs a lowercase identifier `name`, got {name!r}")
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            raise TypeError(f"backend {name!r} must declare `capabilities = Capabilities(...)`")
        if cls.capabilities.batch_invariant and \
                "batch_invariant" not in inspect.signature(cls.implementations).parameters:
            raise TypeError(f"backend {name!r} declares batch_invariant=True, so its implementations() must "
                            f"take a `batch_invariant: bool = False` argument and honour it")

    def implementations(self, batch_invariant: bool = False) -> dict[str, Callable]:
        """Map op name -> callable with the op's reference signature.

        ``batch_invariant=True`` is asked only of backends whose capabilities declare it (a
        backend that does not may omit the argument). Every callable returned then computes each
        row of its output with a reduction order fixed by the row alone: no split-K or split-KV
        chosen from the batch shape, fixed tiles, the same numeric path for prefill and decode
        tokens. Ops left out of that table are served by the configured fallback or refused."""
        raise NotImplementedError

    def unsupported_reasons(self) -> dict[str, str]:
        """Ops this backend declines, with the reason (shown in refusal errors)."""
        return {}

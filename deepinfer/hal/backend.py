"""Backend base class and the capabilities record every backend declares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared rather than sniffed.

    ``device_types``: torch device types it runs on. ``dtypes``: activation dtypes. ``fp8`` /
    ``fp4``: native quantized formats. ``batch_invariant``: every op computes each row with a
    reduction order independent of the batch. ``collectives``: torch.distributed backends its
    EP ops use. ``notes``: plain-language caveats (e.g. "compiled, not run on hardware")."""

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
    :meth:`implementations`. They are found through the ``deepinfer.backends`` entry-point group."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
            raise TypeError(f"backend class {cls.__qualname__} needs a lowercase identifier `name`, got {name!r}")
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            raise TypeError(f"backend {name!r} must declare `capabilities = Capabilities(...)`")

    def implementations(self) -> dict[str, Callable]:
        """Map op name -> callable with the op's reference signature."""
        raise NotImplementedError

    def unsupported_reasons(self) -> dict[str, str]:
        """Ops this backend declines, with the reason (shown in refusal errors)."""
        return {}

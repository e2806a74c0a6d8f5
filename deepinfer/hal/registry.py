"""Backend discovery (entry points), selection, fallback and per-op overrides."""
from __future__ import annotations

import functools
import logging
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping

from deepinfer.hal.backend import Backend, UnsupportedInput
from deepinfer.hal.spec import SPECS

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "deepinfer.backends"


class OpUnavailableError(RuntimeError):
    """A backend lacks an op and no fallback was configured."""


class UnknownBackendError(ValueError):
    """No backend of that name is installed."""


class BatchInvarianceError(ValueError):
    """A batch-invariant op table was asked of a backend that does not declare batch invariance."""


_REGISTERED: dict[str, type[Backend]] = {}
_INSTANCES: dict[tuple, Backend] = {}


@lru_cache(maxsize=None)
def _entry_point_backends() -> dict[str, type[Backend]]:
    found: dict[str, type[Backend]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if cls.name != ep.name:
            raise TypeError(f"entry point {ep.name!r} loads backend named {cls.name!r}; the names must match")
        found[ep.name] = cls
    return found


def available_backends() -> dict[str, type[Backend]]:
    """Backends by name: the ``deepinfer.backends`` entry points plus :func:`register_backend`."""
    return {**_entry_point_backends(), **_REGISTERED}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Make a backend class selectable without an entry point (notebooks, tests); a decorator."""
    _REGISTERED[cls.name] = cls
    _forget(cls.name)
    return cls


def unregister_backend(name: str) -> None:
    """Forget a backend added with :func:`register_backend`."""
    _REGISTERED.pop(name, None)
    _forget(name)


def _forget(name: str) -> None:
    for key in [k for k in _INSTANCES if k[0] == name]:
        del _INSTANCES[key]


def get_backend(name: str, options: Mapping[str, Any] | None = None) -> Backend:
    """The (shared) instance of backend ``name`` with ``options`` (``backend.options``; one
    instance per distinct set)."""
    key = (name, tuple(sorted((options or {}).items())))
    if key not in _INSTANCES:
        backends = available_backends()
        if name not in backends:
            raise UnknownBackendError(
                f"unknown backend {name!r}; installed backends: {sorted(backends)}. "
                f"Install the extra that provides it (e.g. pip install 'deepinfer[{name}]')")
        _INSTANCES[key] = backends[name](options) if options else backends[name]()
    return _INSTANCES[key]


class OpTable:
    """The ops a model calls, resolved once per configuration: ``ops.rms_norm(...)``.

    ``backend`` serves every op unless ``overrides`` names another backend for it. An op the
    chosen backend lacks runs on ``fallback`` (logged once) or raises :class:`OpUnavailableError`
    when called; a call whose inputs the chosen backend does not cover (it raises
    :class:`~deepinfer.hal.backend.UnsupportedInput`) also runs on ``fallback`` when one is
    configured (logged once per op). ``batch_invariant=True`` takes every op from its backend's batch-invariant
    table (``implementations(batch_invariant=True)``); each backend serving an op must declare
    the capability, else :class:`BatchInvarianceError`. ``options`` (``backend.options``) go to
    ``backend``, wherever it serves an op."""

    def __init__(self, backend: str, fallback: str | None = None, overrides: Mapping[str, str] | None = None,
                 batch_invariant: bool = False, options: Mapping[str, Any] | None = None):
        import deepinfer.hal.ops  # noqa: F401  (declares every OpSpec)

        self.backend = get_backend(backend, options)
        self.fallback = (self.backend if fallback == backend else get_backend(fallback)) if fallback else None
        self.overrides = dict(overrides or {})
        self.batch_invariant = batch_invariant
        unknown = sorted(set(self.overrides) - set(SPECS))
        if unknown:
            raise ValueError(f"backend.overrides names unknown ops {unknown}; known ops: {sorted(SPECS)}")
        self.sources: dict[str, str] = {}
        self._tables: dict[str, dict[str, Callable]] = {}
        self._impls: dict[str, Callable] = {}
        for op in SPECS:
            self._impls[op] = self._resolve(op)

    def _table(self, backend: Backend, op: str) -> dict[str, Callable]:
        """``backend``'s implementations in this table's mode (asked once per backend)."""
        if backend.name not in self._tables:
            if not self.batch_invariant:
                self._tables[backend.name] = backend.implementations()
            elif backend.capabilities.batch_invariant:
                self._tables[backend.name] = backend.implementations(batch_invariant=True)
            else:
                raise BatchInvarianceError(
                    f"engine.batch_invariant=true, but backend {backend.name!r} (asked for op {op!r}) does not "
                    f"declare batch invariance; run with engine.batch_invariant=false, or take the op from a "
                    f"backend that declares it (backend.fallback / backend.overrides)")
        return self._tables[backend.name]

    def _resolve(self, op: str) -> Callable:
        named = self.overrides.get(op, self.backend.name)
        chosen = self.backend if named == self.backend.name else get_backend(named)
        impl = self._table(chosen, op).get(op)
        if impl is not None:
            self.sources[op] = chosen.name
            return self._guarded(op, chosen, impl)
        reason = chosen.unsupported_reasons().get(op, "not implemented")
        if self.batch_invariant and reason == "not implemented":
            reason = "no batch-invariant version"
        if self.fallback is not None and op in self._table(self.fallback, op):
            log.warning("op %s: backend %r lacks it (%s); falling back to %r as configured",
                        op, chosen.name, reason, self.fallback.name)
            self.sources[op] = self.fallback.name
            return self._table(self.fallback, op)[op]
        self.sources[op] = "unavailable"

        def refuse(*args, **kwargs):
            raise OpUnavailableError(
                f"op {op!r} is not available on backend {chosen.name!r} ({reason}); set "
                f"backend.fallback=reference to run the reference implementation, or "
                f"+backend.overrides.{op}=<backend> to take it from another backend")

        return refuse

    def _guarded(self, op: str, chosen: Backend, impl: Callable) -> Callable:
        """``impl``, handing calls it refuses as :class:`UnsupportedInput` to the fallback."""
        fallback = self.fallback
        if fallback is None or fallback is chosen or (self.batch_invariant and not fallback.capabilities.batch_invariant):
            return impl
        other = self._table(fallback, op).get(op)
        if other is None:
            return impl
        warned = []

        @functools.wraps(impl)
        def guarded(*args, **kwargs):
            try:
                return impl(*args, **kwargs)
            except UnsupportedInput as error:
                if not warned:
                    warned.append(op)
                    log.warning("op %s: %s; running %r for such calls, as configured (backend.fallback)",
                                op, str(error), fallback.name)
                return other(*args, **kwargs)

        return guarded

    def __getattr__(self, op: str) -> Callable:
        impls = self.__dict__.get("_impls", {})
        if op in impls:
            return impls[op]
        raise AttributeError(f"no HAL op named {op!r}; known ops: {sorted(impls)}")

    def __repr__(self) -> str:
        return (f"OpTable(backend={self.backend.name!r}, fallback={getattr(self.fallback, 'name', None)!r}, "
                f"batch_invariant={self.batch_invariant})")

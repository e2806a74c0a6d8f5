"""Hardware-abstraction layer: op contracts, backends and their selection."""
from deepinfer.hal.backend import Backend, Capabilities, UnsupportedInput
from deepinfer.hal.registry import (
    BatchInvarianceError, OpTable, OpUnavailableError, UnknownBackendError, available_backends, get_backend,
    register_backend, unregister_backend,
)
from deepinfer.hal.spec import SPECS, OpCase, OpSpec, Tolerance

__all__ = [
    "Backend", "BatchInvarianceError", "Capabilities", "OpTable", "OpUnavailableError", "UnknownBackendError",
    "available_backends", "get_backend", "register_backend", "unregister_backend", "SPECS", "OpCase", "OpSpec", "Tolerance",
    "UnsupportedInput",
]

import deepinfer.hal.ops  # noqa: E402,F401  (declares every op's OpSpec)

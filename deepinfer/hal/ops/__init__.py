"""Every HAL op's contract; importing this package declares them all."""
from deepinfer.hal.ops import norm  # noqa: F401

"""CPU emulation of the ascend950 kernels' plans (``backend.execution=emulate``): the same tile
sizes and per-core block decomposition, float32 accumulation with one rounding at the copy out,
the A5 quantized formats. It checks the plans and the numerics they imply, not the hardware:
nothing here is bit-exact with a 950."""

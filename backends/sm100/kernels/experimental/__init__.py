"""Kernels compiled and lowered in CI but never run on hardware (the Blackwell tcgen05/TMEM
variants, chosen with ``backend.options.tcgen05=true``)."""

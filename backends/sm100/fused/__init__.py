"""Triton kernels for the small fused elementwise and reduction ops (one module per op); each
module imports triton, so a wrapper imports it on its first call."""

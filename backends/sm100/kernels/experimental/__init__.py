"""Kernels compiled and lowered in CI but never run on hardware: the Blackwell tcgen05/TMEM
variants (chosen with ``backend.options.tcgen05=true``) and the native-FP8 wgmma grouped GEMM
for Hopper (not served; its ``main()`` checks and times it on a GPU)."""

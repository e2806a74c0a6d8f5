"""Kernels that are not served: the Blackwell tcgen05/TMEM variants (chosen with
``backend.options.tcgen05=true``; compiled and lowered in CI, never run on hardware) and the
native-FP8 wgmma grouped GEMM for Hopper (correct on a GPU but slower than the served
decode-to-bf16 path; its ``main()`` checks and times it)."""

"""Kernels that are not served: the Blackwell tcgen05/TMEM variants (chosen with
``backend.options.tcgen05=true``; compiled and lowered in CI, never run on hardware) and the
native-FP8 wgmma grouped GEMM for Hopper (correct on a GPU but slower than the served
decode-to-bf16 path; its ``main()`` checks and times it), and the served native FP8 grouped GEMM
on 2-CTA clusters that multicast the weight tile (compiled, not yet run on hardware; its
``main()`` checks it and times it beside the served kernel)."""

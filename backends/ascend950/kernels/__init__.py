"""ascend950 kernels in tilelang-ascend's own language (cube and vector scopes, explicit L1, UB
and L0 buffers): ``rms_norm``, ``grouped_gemm`` (bf16, float32), ``grouped_gemm_fp8``,
``mla_sparse_decode`` (bf16 or FP8 cache), ``mla_sparse_prefill``, ``apply_rope`` and
``kv_norm_rope_store`` (bf16, fp8 and index_fp4 caches). Each module builds one kernel from plain integers (shapes and
the tile sizes of the emulation's plan, :mod:`deepinfer_backends.ascend950.emulate`) and imports
``tilelang`` only inside its builder, so the modules import anywhere; the kernels compile with CANN
and run only where ``torch_npu`` imports and an NPU is present. The modules import nothing from
deepinfer, only one another, so :mod:`experiments.ascend_lower` can import this folder as a package
in an interpreter that has tilelang-ascend and nothing else."""

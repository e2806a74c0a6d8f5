"""Every HAL op's contract; importing this package declares them all."""
from deepinfer.hal.ops import (  # noqa: F401
    activation,
    all_to_all,
    compress,
    grouped_gemm,
    indexer,
    kv_cache,
    kv_norm_rope_store,
    mhc,
    mla,
    norm,
    rope,
    routing,
    sampling,
    speculative,
    swa_replay,
    token_bitmask,
)

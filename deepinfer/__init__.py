"""deepinfer: a backend-agnostic research framework for DeepSeek-V4.1-class MoE inference.

``from deepinfer import LLM, SamplingParams`` for offline generation; ``deepinfer.hal`` for ops
and backends. Heavy imports wait until used."""

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        import deepinfer.engine as engine

        return getattr(engine, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")

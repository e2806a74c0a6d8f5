"""The offline engine: LLM, SamplingParams, RequestOutput."""
from deepinfer.engine.llm import LLM
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

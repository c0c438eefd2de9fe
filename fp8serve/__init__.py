"""fp8serve: an LLM inference and serving engine with an FP8 KV cache and
calibrated per-layer scaling factors."""

from fp8serve.entrypoints.llm import LLM
from fp8serve.outputs import CompletionOutput, Logprob, RequestOutput
from fp8serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

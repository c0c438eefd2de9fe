"""fp8serve: an LLM inference and serving engine with an FP8 KV cache and
calibrated per-layer scaling factors."""

from fp8serve.logger import configure_default_logging

configure_default_logging()

from fp8serve.entrypoints.llm import LLM  # noqa: E402
from fp8serve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from fp8serve.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

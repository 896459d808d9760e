"""jaxinfer: an LLM inference engine on JAX and Pallas."""

from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

"""jaxinfer: an LLM inference engine on JAX and Pallas.

The public names are imported on first use, so `import jaxinfer.models.llama` (the GPU check,
kernel research) does not pull in the tokenizer, grammar and server dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "CompletionOutput": "jaxinfer.outputs",
    "RequestOutput": "jaxinfer.outputs",
    "SamplingParams": "jaxinfer.sampling_params",
    "PoolingParams": "jaxinfer.pooling_params",
    "LoRARequest": "jaxinfer.lora_request",
}

# _EXPORTS' keys
__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.lora_request import LoRARequest
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.pooling_params import PoolingParams
    from jaxinfer.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

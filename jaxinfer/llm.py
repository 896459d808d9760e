"""The offline Python API: LLM(...).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from jaxinfer.config import EngineOptions
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.layers.kernel_registry import KernelRegistry
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import RequestOutput
from jaxinfer.pooling_params import PoolingParams, check_dimensions
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Runs a model over a batch of prompts with continuous batching.

    Args:
        model: None for the default model (SmolLM2-135M-Instruct), a Hugging Face folder or a
            .gguf file.
        kernels: a KernelRegistry holding implementations registered by name, for
            attention_impl, ffn_impl and norm_impl to select (default: the built-in ones).
        **engine_options: see EngineOptions (max_model_len, max_num_seqs,
            max_num_batched_tokens, block_size, num_kv_blocks, kv_cache_memory_gb, dtype, ...).
        use_tqdm: a progress bar of the warm-up (compiling the engine's programs).
    """

    def __init__(
        self,
        model: str | None = None,
        kernels: KernelRegistry | None = None,
        use_tqdm: bool = True,
        **engine_options,
    ):
        options = EngineOptions(model=model, **engine_options)
        self.engine = LLMEngine(options, kernels, show_progress=use_tqdm)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (strings or token-id lists); results in prompt order.

        `priority` (one integer per prompt, lower first) only matters when the prompts do not
        all fit in the engine at once. `lora_request`: the LoRA adapter of every prompt, or
        one per prompt (None: the base model); the engine needs enable_lora."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts), "LoRARequest")
        return self._run(prompts, params_list, use_tqdm, True, priority=priority, loras=loras)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them
        (`lora_request` as in generate)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        params_list = _params_per_prompt(sampling_params, len(prompts))
        loras = _per_prompt(lora_request, len(prompts), "LoRARequest")
        return self._run(prompts, params_list, use_tqdm, False, loras=loras)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One embedding per prompt (RequestOutput.embedding, f32[E]), pooled as
        `pooling_params` says (default: the engine's pooling_type, normalized); the prompts
        run through the same steps as generation, batched together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        config = self.engine.config.model
        pooling = pooling_params or PoolingParams(config.pooling_type)
        check_dimensions(pooling, config.arch.hidden_size)
        params = [pooling.sampling_params()] * len(prompts)
        return self._run(list(prompts), params, use_tqdm, True, pooling=pooling)

    def _run(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        add_special_tokens: bool,
        priority: Sequence[int] | None = None,
        pooling: PoolingParams | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        if pooling is None and engine.config.model.runner == "pooling":
            raise ValueError("this engine serves embeddings only (runner 'pooling'): use embed")
        ids = []
        try:
            priorities = priority if priority is not None else [0] * len(prompts)
            loras = loras or [None] * len(prompts)
            for prompt, params, rank, lora in zip(
                prompts, params_list, priorities, loras, strict=True
            ):
                # Only the final outputs are returned: the engine builds nothing else.
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                prepared = engine.prepare_request(prompt, params, add_special_tokens, lora)
                if pooling is not None:
                    prepared = dataclasses.replace(prepared, pooling=pooling)
                request = engine.add_prepared(prepared, priority=rank)
                ids.append(request.request_id)
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as progress:
            while len(results) < len(ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        progress.update(1)
        return [results[request_id] for request_id in ids]


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} SamplingParams for {num_prompts} prompts")
    return params_list


def _per_prompt(value, num_prompts: int, kind: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if value is None or not isinstance(value, Sequence):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {kind}s for {num_prompts} prompts")
    return values

"""Layer-by-layer and end-to-end parity with HF transformers: a harness that runs one model
in both and the checks that compare them."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxinfer.config import EngineOptions
from jaxinfer.config.configure import configure
from jaxinfer.engine.execution.batch_builder import BatchBuilder
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.execution.step import SchedulerOutput
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.causal_lm import causal_lm
from jaxinfer.models.llama import build_llama
from jaxinfer.outputs import RequestMetrics
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner
from jaxinfer.sampling_params import SamplingParams
from tests.support.engines import scheduled

BLOCK_SIZE = 8


NUM_BLOCKS = 64


class Harness:
    """Runs the model runner's jitted step on hand-made scheduler outputs."""

    def __init__(
        self,
        folder,
        layer_execution: str,
        tensor_parallel_size: int = 1,
        weight_layout: str = "in_out",
        matmul=None,
        attention=None,
        expert_parallel: bool = False,
    ):
        options = EngineOptions(
            model=str(folder),
            layer_execution=layer_execution,
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_BLOCKS,
            max_num_batched_tokens=128,
            token_buckets=(2, 16, 64),  # and 128: few programs, the kernels' few-row paths
            max_num_seqs=8,
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel,
            weight_layout=weight_layout,
            matmul_impl="xla",
            attention_impl="reference",
            gguf_weights="off",
        )
        self.config, _ = configure(options, folder)
        arch = self.config.model.arch
        partitioner = Partitioner(make_mesh(tensor_parallel_size), expert_parallel)
        params = load_llama_params(folder, arch, np.float32, self.config.parallel.kv_replicas)
        graphdef, state = build_llama(
            arch, params, jnp.float32, partitioner, weight_layout, model_class=causal_lm(arch)
        )
        kernels = ModelKernels(weight_layout=weight_layout, matmul=matmul)
        self.partitioner = partitioner
        if attention is not None:
            kernels = dataclasses.replace(kernels, attention=attention)
        self.state = state
        self.runner = ModelRunner(self.config, graphdef, state, kernels, partitioner)
        self.builder = BatchBuilder(self.config)
        self.folder = folder
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        self.rng = np.random.default_rng(0)
        self.free_blocks = list(self.rng.permutation(np.arange(1, NUM_BLOCKS)))
        self.live: list[str] = []  # request ids, oldest first

    def new_request(self, request_id: str, prompt: list[int], extra_tokens: int = 0) -> Request:
        """A request with blocks for its prompt and `extra_tokens` more."""
        num_blocks = -(-(len(prompt) + extra_tokens) // BLOCK_SIZE)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0),
            eos_token_ids=frozenset(),
            seed=0,
            metrics=RequestMetrics(arrival_time=0.0),
        )
        request.block_ids = [int(self.free_blocks.pop()) for _ in range(num_blocks)]
        self.live.append(request.request_id)
        if len(self.live) > self.config.scheduler.max_num_seqs:  # <= 8 live device rows
            self.builder.rows.release(self.live.pop(0))
        return request

    def step(self, chunks: list[tuple[Request, int]]) -> np.ndarray:
        """Runs the next `count` tokens of each request; returns f32[num_requests, V]."""
        items = tuple(scheduled(r, n, new_row=r.num_computed_tokens == 0) for r, n in chunks)
        output = SchedulerOutput(items, sum(n for _, n in chunks))
        batch, _, _ = self.runner.prepare(self.builder.build(output))
        logits = self.runner.forward(batch)
        for request, count in chunks:
            request.num_computed_tokens += count
        return np.asarray(logits)[: len(chunks)]

    def greedy(self, prompts: dict[str, list[int]], num_tokens: int) -> dict[str, list[int]]:
        """Greedy generations of `num_tokens` tokens, the prompts prefilled in one step and
        decoded together."""
        requests = [self.new_request(name, p, num_tokens) for name, p in prompts.items()]
        logits = self.step([(r, r.num_prompt_tokens) for r in requests])
        for _ in range(num_tokens):
            for request, row in zip(requests, logits, strict=True):
                request.append_accepted_token(int(np.argmax(row)))
            if requests[0].num_output_tokens == num_tokens:
                break
            logits = self.step([(r, 1) for r in requests])
        return {r.request_id: list(r.output_token_ids) for r in requests}

    def reference(self, prompt: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor([prompt])).logits[0].numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-4):
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= rtol, f"max relative error {error:.2e} > {rtol:.0e}"


def check_prompt_in_one_step(harness, rtol: float = 1e-4):
    prompt = list(np.random.default_rng(1).integers(0, 320, size=37))
    request = harness.new_request("a", prompt)
    logits = harness.step([(request, len(prompt))])
    assert_close(logits[0], harness.reference(prompt)[-1], rtol)


def check_prompt_in_chunks_over_shuffled_blocks(harness, rtol: float = 1e-4):
    prompt = list(np.random.default_rng(2).integers(0, 320, size=53))
    request = harness.new_request("b", prompt)
    assert request.block_ids != sorted(request.block_ids)
    reference = harness.reference(prompt)
    position = 0
    for count in (5, 8, 1, 17, 22):  # chunk edges inside and across blocks
        logits = harness.step([(request, count)])
        position += count
        assert_close(logits[0], reference[position - 1], rtol)


def check_prompt_inside_mixed_batch(harness, rtol: float = 1e-4):
    rng = np.random.default_rng(3)
    prompts = {
        name: list(rng.integers(0, 320, size=n)) for name, n in [("x", 29), ("y", 41), ("z", 7)]
    }
    requests = {name: harness.new_request(name, p) for name, p in prompts.items()}
    references = {name: harness.reference(p) for name, p in prompts.items()}
    # Bring x to a "decoding" state and y part-way through its prompt.
    harness.step([(requests["x"], 28)])
    harness.step([(requests["y"], 16)])
    # One step: x decodes its last token, y continues its prefill, z prefills whole.
    logits = harness.step([(requests["x"], 1), (requests["y"], 20), (requests["z"], 7)])
    assert_close(logits[0], references["x"][28], rtol)
    assert_close(logits[1], references["y"][35], rtol)
    assert_close(logits[2], references["z"][6], rtol)

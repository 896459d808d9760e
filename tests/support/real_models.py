"""What the real-model tests read: a preset's references (tools/real_model_references.py) and
an engine's residual stream after every layer for one prompt."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.execution.batch_builder import BatchBuilder
from jaxinfer.engine.execution.step import SchedulerOutput
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import scheduled
from tools.real_model_prompts import projection

REFERENCES = Path(__file__).resolve().parents[1] / "data" / "real_models"


def reference(preset: str) -> dict:
    return json.loads((REFERENCES / f"{preset}.json").read_text())


def residual_streams(llm: LLM, prompt: list[int]) -> np.ndarray:
    """f32[L, T, 16]: the residual stream after each decoder layer of `prompt` prefilled in one
    step on the engine's weights and kernels (the layer scan, collecting), projected as the
    references are."""
    engine = llm.engine
    runner = engine.runner
    assert runner.layer_execution == "scan"
    arch = engine.config.model.arch
    graphdef, state = nnx.split(LlamaForCausalLM(arch, nnx.to_pure_dict(runner.state)))

    def run(state, kv_cache, batch):
        model = nnx.merge(graphdef, state)
        return model.residual_streams(
            kv_cache, batch, kernels=runner.kernels, partitioner=runner.partitioner
        )

    # (a builder of its own: the engine's holds the rows of the requests that ended last
    # until its next step)
    builder = BatchBuilder(engine.config)
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    try:
        assert engine.kv_cache_manager.allocate_blocks(request, len(prompt))
        output = SchedulerOutput((scheduled(request, len(prompt), new_row=True),), len(prompt))
        batch, _, _ = runner.prepare(builder.build(output))
        program = jax.jit(run, donate_argnums=1)
        runner.kv_cache, streams = program(state, runner.kv_cache, batch)
    finally:
        engine.abort_request(request.request_id)
    streams = np.asarray(streams)[:, : len(prompt)]  # the step's padding cut
    return streams @ projection(streams.shape[-1])


@contextlib.contextmanager
def served(llm: LLM, name: str):
    """The server app (what `jaxinfer serve` runs) on the engine of `llm`, on a local port."""
    url, server = serve(build_app(AsyncEngine(llm.engine), ServerConfig(served_model_name=name)))
    try:
        yield url
    finally:
        server.should_exit = True

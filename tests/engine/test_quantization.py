"""Weight-only int8: the quantizer against numpy, and the engine's int8 model against its
float32 model (the default model's check is in test_default_model.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from jaxinfer import LLM, SamplingParams
from jaxinfer.layers.quantization import quantize_int8
from jaxinfer.layers.weights import Int8
from tests.support.checks import check_logprobs_close
from tests.support.engines import build_llm, layer_weights

pytestmark = pytest.mark.engine

INT8_ATOL = 0.05  # int8 against float32 on the common prefix (nats; 0.017 measured)

PROMPTS = ["The quick brown fox", "def f(x):", "hello world, how are you"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_int8_per_output_channel(axis):
    rng = np.random.default_rng(axis)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero channel (axis 0) or part of each (axis 1)
    q, scale = quantize_int8(w, axis)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == (w.shape[1 - axis],)
    expected_scale = np.abs(w).max(axis=axis) / 127
    expected_scale[expected_scale == 0] = 1.0
    np.testing.assert_allclose(scale, expected_scale, rtol=1e-6)
    restored = q * np.expand_dims(scale, axis)
    assert np.all(np.abs(restored - w) <= np.expand_dims(scale, axis) / 2 + 1e-7)
    assert np.all(np.abs(q).max(axis=axis)[expected_scale != 1.0] == 127)
    q_device, scale_device = quantize_int8(jnp.asarray(w), axis)  # restored checkpoints
    np.testing.assert_array_equal(np.asarray(q_device), q)
    np.testing.assert_allclose(np.asarray(scale_device), scale, rtol=1e-6)


def generate(llm: LLM):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        {},  # the CPU default: "out_in" weights, the C++ kernel, the layers under a scan
        {"matmul_impl": "xla"},  # through XLA's ops (per-layer programs)
        {"layer_execution": "scan", "weight_layout": "in_out"},
        {"tensor_parallel_size": 2},
    ],
    ids=["scan-out_in-cpu_kernel", "per_layer-out_in-xla", "scan-in_out", "tp2"],
)
def test_int8_engine_stays_logprob_close_to_float32(tiny_model_dir, tiny_llm, options):
    if not options and not can_build():
        pytest.skip("no C++ compiler to build the matmul kernel")
    llm = build_llm(tiny_model_dir, "tiny", quantization="int8", **options)
    uses_kernel = llm.engine.runner.kernels.matmul is not None
    assert uses_kernel == (not options)  # "auto" picks it on one CPU device in "out_in" only
    layer = layer_weights(llm.engine.runner)
    gate_up = layer["gate_up_proj"]
    assert isinstance(gate_up, Int8)
    assert (gate_up.q.dtype, gate_up.scale.dtype) == (jnp.int8, jnp.float32)
    for i, (ours, theirs) in enumerate(zip(generate(llm), generate(tiny_llm), strict=True)):
        largest = check_logprobs_close(ours, theirs, f"prompt {i}", atol=INT8_ATOL)
        print(f"{i}: largest logprob difference {largest:.2e}")


def test_unknown_quantization_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        build_llm(tiny_model_dir, "tiny", quantization="int3")

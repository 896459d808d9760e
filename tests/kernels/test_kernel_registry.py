"""Kernels chosen by name from the engine config, swapped inside the full engine under jit."""

from __future__ import annotations

import pytest

from cpu_kernels.build import can_build
from cpu_kernels.matmul.kernel import matmul
from cpu_kernels.paged_attention.kernel import paged_attention
from jaxinfer import LLM, SamplingParams
from jaxinfer.layers.kernel_registry import ModelKernels, default_registry
from jaxinfer.layers.native_kernels import KernelMatmul
from pallas_kernels.add_rms_norm.reference import add_rms_norm_reference
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.support.engines import PRESETS, build_llm

pytestmark = pytest.mark.engine

OPTIONS = PRESETS["tiny"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_llm):
    # "auto" on CPU: "out_in" weights, the C++ attention and matmul kernels (where they can
    # be built) and the reference everywhere else
    built = can_build()
    attention = paged_attention if built else ragged_paged_attention_reference
    expected = ModelKernels(
        weight_layout="out_in",
        attention=attention,
        matmul=KernelMatmul(matmul) if built else None,
    )
    assert tiny_llm.engine.runner.kernels == expected
    return tokens(tiny_llm)


def test_pallas_kernels_in_the_engine_give_the_same_greedy_tokens(tiny_model_dir, reference_tokens):
    llm = build_llm(
        tiny_model_dir,
        None,
        attention_impl="pallas_interpret",
        ffn_impl="pallas_interpret",
        norm_impl="pallas_interpret",
        **OPTIONS,
    )
    assert llm.engine.runner.kernels.ffn.func is fused_ffn
    assert llm.engine.runner.kernels.weight_layout == "in_out"  # what the Pallas FFN takes
    assert tokens(llm) == reference_tokens


def test_a_registered_function_runs_inside_the_jitted_step(tiny_model_dir, reference_tokens):
    traced = []

    def my_attention(*args, **kwargs):  # research code: same signature as the reference
        traced.append(kwargs["sm_scale"])
        return ragged_paged_attention_reference(*args, **kwargs)

    def my_norm(x, residual, weight, *, eps):
        traced.append(eps)
        return add_rms_norm_reference(x, residual, weight, eps=eps)

    registry = default_registry()
    registry.register("attention", "mine", my_attention)
    registry.register("norm", "mine", my_norm)
    llm = build_llm(
        tiny_model_dir,
        None,
        kernels=registry,
        attention_impl="mine",
        norm_impl="mine",
        layer_execution="scan",
        **OPTIONS,
    )
    assert traced  # traced while warm-up compiled the steps
    count = len(traced)
    assert tokens(llm) == reference_tokens
    assert len(traced) == count  # and never again: the steps run compiled


def test_unknown_names_and_bad_registrations_are_clear_errors(tiny_model_dir):
    with pytest.raises(ValueError, match=r"no attention kernel named 'flash9'.*'reference'"):
        build_llm(tiny_model_dir, None, attention_impl="flash9", **OPTIONS)
    registry = default_registry()
    with pytest.raises(ValueError, match="kind"):
        registry.register("softmax", "mine", len)
    with pytest.raises(ValueError, match="auto"):
        registry.register("ffn", "auto", len)
    with pytest.raises(TypeError, match="callable"):
        registry.register("ffn", "mine", 3)
    assert registry.names("ffn") == ["pallas", "pallas_interpret", "reference"]
    with pytest.raises(ValueError, match="weight_layout"):
        build_llm(tiny_model_dir, None, weight_layout="column_major", **OPTIONS)

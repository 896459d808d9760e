"""jaxinfer's Llama against Hugging Face transformers on the same (tiny, random) weights.

Logits must agree to 1e-4 relative error when a prompt runs in one step, in several chunks over
shuffled non-contiguous blocks, and inside a mixed batch with other requests at other stages.
"""

from __future__ import annotations

import pytest

from jaxinfer.layers.native_kernels import KernelMatmul
from tests.support.models import make_tiny_model
from tests.support.parity import (
    Harness,
    check_prompt_in_chunks_over_shuffled_blocks,
    check_prompt_in_one_step,
    check_prompt_inside_mixed_batch,
)

pytestmark = pytest.mark.engine

VARIANTS = {
    "llama": {},
    "tied_embeddings": {"tie_word_embeddings": True},
    "llama3_rope_scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
    "qwen2_qkv_bias": {"architecture": "qwen2", "num_key_value_heads": 1},
    # YaRN: frequencies blended between interpolated and extrapolated, cos and sin times the
    # attention factor HF derives (0.1 ln 4 + 1)
    "qwen2_yarn_rope_scaling": {
        "architecture": "qwen2",
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mha_head_dim_32": {"num_attention_heads": 2, "num_key_value_heads": 2},
}


# Both executions and both weight layouts (jaxinfer.layers.linear): scan with "in_out"
# (accelerators), per_layer with "out_in" (CPU without the kernels); and the "out_in"
# projections and attention through the C++ kernels (jaxinfer.layers.native_kernels) under
# the scan, the CPU default, on the one-KV-head and the MHA variants. (Per-layer programs
# with the kernels run in the engine tests.)
CPU_KERNEL_VARIANTS = ("qwen2_qkv_bias", "mha_head_dim_32")  # one KV head with biases; MHA
EXECUTIONS = [
    ("scan", "in_out", "xla"),
    ("per_layer", "out_in", "xla"),
    ("scan", "out_in", "cpu"),  # the CPU default: the kernel reads stacked weights in place
]
CASES = [
    (variant, execution)
    for variant in VARIANTS
    for execution in EXECUTIONS
    if execution[2] == "xla" or variant in CPU_KERNEL_VARIANTS
]


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """Each variant's model folder, written once for all its executions."""
    folders: dict[str, object] = {}

    def folder(variant: str):
        if variant not in folders:
            folders[variant] = make_tiny_model(
                tmp_path_factory.mktemp(variant), **VARIANTS[variant]
            )
        return folders[variant]

    return folder


@pytest.fixture(scope="module", params=CASES, ids=[f"{v}-{'-'.join(e)}" for v, e in CASES])
def harness(request, model_folders):
    variant, (layer_execution, weight_layout, matmul_impl) = request.param
    model_folder = model_folders(variant)
    if matmul_impl == "xla":
        return Harness(model_folder, layer_execution, weight_layout=weight_layout)
    return Harness(
        model_folder,
        layer_execution,
        weight_layout=weight_layout,
        matmul=KernelMatmul(request.getfixturevalue("cpu_matmul")),
        attention=request.getfixturevalue("cpu_attention"),
    )


def test_prompt_in_one_step(harness):
    check_prompt_in_one_step(harness)


def test_prompt_in_chunks_over_shuffled_blocks(harness):
    check_prompt_in_chunks_over_shuffled_blocks(harness)


def test_prompt_inside_mixed_batch(harness):
    check_prompt_inside_mixed_batch(harness)

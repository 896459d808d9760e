"""A MoE model's GGUF file read in place (jaxinfer.model_loader.gguf_weights): the experts as
GGUFWeights of X experts per layer, multiplied by the block kernel's grouped product
(cpu_kernels.gguf_matmul.kernel.gguf_grouped_matmul), on a tiny Qwen2-MoE (routed experts, a
shared expert and its gate) written as a k-quant GGUF file: each expert's blocks against the
converted float weights, and the engine on them against the engine on float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul.reference import LAYOUTS, dequantize_layer
from jaxinfer import SamplingParams
from jaxinfer.layers.weights import GGUFWeight
from jaxinfer.model_loader.gguf_weights import load_gguf_params
from jaxinfer.model_loader.model_cache import gguf_folder
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from tests.engine.test_gguf_blocks import comparison_options, converted
from tests.support.engines import build_llm
from tests.support.gguf import write_gguf
from tests.support.models import make_family_model

pytestmark = pytest.mark.engine

Q4_0, Q4_K, Q8_0 = (gguf.GGMLQuantizationType[t] for t in ("Q4_0", "Q4_K", "Q8_0"))
# As a Q4_K_M file keeps a MoE model: Q4_K attention and experts, the experts' down
# projections in Q8_0 (more bits), a Q4_0 shared expert, a Q8_0 embedding and head.
QUANTIZED = {
    **dict.fromkeys(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"), Q4_K),
    **dict.fromkeys(("experts.gate_proj.weight", "experts.up_proj.weight"), Q4_K),
    "experts.down_proj.weight": Q8_0,
    **dict.fromkeys(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"), Q4_0),
    "shared_expert.down_proj.weight": Q4_0,
    "embed_tokens.weight": Q8_0,
    "lm_head.weight": Q8_0,
}
EXPERTS = ["experts_gate_up", "experts_down"]
BLOCKS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", *EXPERTS, "embed", "lm_head"]
needs_compiler = pytest.mark.skipif(not can_build(), reason="no C++ compiler for the kernels")


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """(GGUF path, its converted folder) of a tiny Qwen2-MoE whose every K is a multiple of
    256 (the k-quants' blocks)."""
    hf_folder = make_family_model(
        tmp_path_factory.mktemp("hf"),
        "qwen2_moe",
        hidden_size=256,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=4,
    )
    path = tmp_path_factory.mktemp("gguf") / "tiny-moe.gguf"
    write_gguf(hf_folder, path, QUANTIZED)
    return path, gguf_folder(path, tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("interleave", [False, True])
def test_experts_read_in_place_are_the_converted_experts(moe_gguf, interleave):
    """Expert x of layer l (at l * X + x) dequantizes (by the gguf package) to exactly the
    converted folder's expert in the engine's "out_in" order (gate rows then up rows); the
    router and the shared expert's gate stay float, the same arrays."""
    path, folder = moe_gguf
    config, floats = converted(folder)
    params, kept = load_gguf_params(path, config, np.float32, interleave)
    assert kept == BLOCKS
    layers, X = config.num_hidden_layers, config.moe.num_experts
    for name in EXPERTS:
        w = params["layers"][name]
        assert isinstance(w, GGUFWeight) and w.groups == X
        assert w.data.shape[0] == layers * X and list(w.layer) == list(range(layers))
        fmt = "Q4_K" if name == "experts_gate_up" else "Q8_0"
        formats = {int(f) for f, rows, _ in w.table[0] if rows}
        assert formats == {LAYOUTS[f"{fmt}_X16" if interleave else fmt][0]}
        want = np.asarray(floats["layers"][name].w)  # [L, X, *out, K]
        for layer in range(layers):
            for x in range(X):
                i = layer * X + x
                got = dequantize_layer(w.data[i], w.table[i], w.k)
                np.testing.assert_array_equal(
                    got, want[layer, x].reshape(got.shape), err_msg=f"{name} {layer} {x}"
                )
    loaded = load_llama_params(folder, config, np.float32)["layers"]
    for name in ("router", "shared_expert_gate", "input_norm"):
        np.testing.assert_array_equal(params["layers"][name], loaded[name], err_msg=name)


@needs_compiler
@pytest.mark.parametrize("int8_activations", [False, True])
def test_engine_on_expert_blocks_matches_the_engine_on_float_weights(
    moe_gguf, int8_activations, cpu_kernel_dir
):
    """Greedy tokens the same and logprobs close, over prompt chunks and decodes of several
    requests (experts of one, several and no rows): exact activations differ from the float
    weights' products by summation order, int8 ones by their rounding too."""
    path, _ = moe_gguf
    options = comparison_options(cpu_kernel_dir)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [11, 12], [20, 21, 22]]
    runs = {}
    for mode in ("on", "off"):
        extra = {"int8_activations": int8_activations} if mode == "on" else {}
        llm = build_llm(path, None, gguf_weights=mode, **options, **extra)
        assert llm.engine.gguf_weights == (BLOCKS if mode == "on" else [])
        runs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # int8: x rounded per block before every projection, the routers' inputs too (a near tie
    # of two experts' weights moves a logprob by a few hundredths)
    tolerance = 0.1 if int8_activations else 1e-4
    gaps = []
    for ours, theirs in zip(runs["on"], runs["off"], strict=True):
        first = theirs.token_ids[0]
        assert ours.token_ids[0] == first
        gaps.append(abs(ours.logprobs[0][first] - theirs.logprobs[0][first]))
        if not int8_activations:
            assert ours.token_ids == theirs.token_ids
    assert max(gaps) < tolerance
    assert (max(gaps) > 1e-3) == int8_activations  # the rounding is in effect, or not


def test_experts_in_another_type_are_read_as_float(tmp_path):
    """A file whose experts are F32 (a type the kernel does not read): the experts are the
    converted folder's float arrays, joined as transformers packs them, the rest in blocks."""
    hf_folder = make_family_model(tmp_path / "hf", "qwen2_moe", shared_expert_intermediate_size=64)
    path = tmp_path / "moe.gguf"
    write_gguf(hf_folder, path, dict.fromkeys(("q_proj.weight", "o_proj.weight"), Q8_0))
    folder = gguf_folder(path, tmp_path / "cache")
    config, _ = converted(folder)
    params, kept = load_gguf_params(path, config, np.float32)
    assert kept == ["o_proj"]
    loaded = load_llama_params(folder, config, np.float32)["layers"]
    for name in EXPERTS:
        np.testing.assert_array_equal(params["layers"][name], loaded[name], err_msg=name)

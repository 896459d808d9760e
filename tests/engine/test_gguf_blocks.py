"""A GGUF model's weights read in place (jaxinfer.model_loader.gguf_weights,
jaxinfer.layers.weights.GGUFWeight): the tensor table against the gguf package's reader, the
blocks in the engine's row order against the converted float weights, and an engine on them
against the engine on float weights, on tiny models written as GGUF files (Q4_1 projections
and a Q8_0 embedding; Q4_K and Q4_0 projections); and the int4 path that takes a file's 4-bit
blocks as its int4 weights (jaxinfer.model_loader.gguf_blocks)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul.kernel import has_avx512_vnni
from cpu_kernels.gguf_matmul.reference import LAYOUTS, dequantize_layer
from jaxinfer import SamplingParams
from jaxinfer.layers.linear import OUT_IN
from jaxinfer.layers.weights import GGUFWeight, Int4
from jaxinfer.model_loader import gguf_weights
from jaxinfer.model_loader.gguf_blocks import load_gguf_blocks, verified_blocks
from jaxinfer.model_loader.gguf_tensors import read_tensors
from jaxinfer.model_loader.gguf_weights import load_gguf_params
from jaxinfer.model_loader.model_cache import gguf_folder, source_gguf
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.families.hf_config import read_config
from jaxinfer.models.params import as_weights, to_layout
from pallas_kernels.int4_matmul.reference import dequantize as int4_dequantize
from tests.support.engines import build_llm, layer_weights
from tests.support.gguf import NUM_KV_HEADS, write_gguf
from tests.support.models import make_tiny_model

pytestmark = pytest.mark.engine

Q4_0, Q4_1, Q4_K, Q8_0 = (gguf.GGMLQuantizationType[t] for t in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"))
QUANTIZED = {
    **dict.fromkeys(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"), Q4_1),
    **dict.fromkeys(("gate_proj.weight", "up_proj.weight", "down_proj.weight"), Q4_1),
    "embed_tokens.weight": Q8_0,
}
ALL_BLOCKS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed"]
PROJECTIONS = ALL_BLOCKS[:-1]
# A k-quant file as llama.cpp users have them: Q4_K projections (a Q4_0 one among them), a Q8_0
# embedding.
K_QUANTIZED = {
    **dict.fromkeys(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"), Q4_K),
    **dict.fromkeys(("gate_proj.weight", "up_proj.weight"), Q4_K),
    "down_proj.weight": Q4_0,
    "embed_tokens.weight": Q8_0,
}
needs_compiler = pytest.mark.skipif(not can_build(), reason="no C++ compiler for the kernels")


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    """(GGUF path, its converted folder) of a tiny tied model (every K a multiple of 32)."""
    hf_folder = make_tiny_model(
        tmp_path_factory.mktemp("hf"),
        num_key_value_heads=NUM_KV_HEADS,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf"
    write_gguf(hf_folder, path, QUANTIZED)
    return path, gguf_folder(path, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory):
    """(GGUF path, its converted folder) of a tiny tied model of Q4_K / Q4_0 projections (every
    K a multiple of 256)."""
    hf_folder = make_tiny_model(
        tmp_path_factory.mktemp("hf"),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_key_value_heads=NUM_KV_HEADS,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_k.gguf"
    write_gguf(hf_folder, path, K_QUANTIZED)
    return path, gguf_folder(path, tmp_path_factory.mktemp("cache"))


def converted(folder):
    config = read_config(folder / "config.json")
    params = load_llama_params(folder, config, np.float32)
    return config, to_layout(as_weights(config, params), OUT_IN)


def test_tensor_table_matches_the_gguf_reader(q4_gguf):
    path, _ = q4_gguf
    ours = read_tensors(path)
    theirs = gguf.GGUFReader(path).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        tensor = ours[t.name]
        assert tensor.type_name == t.tensor_type.name
        assert tensor.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(np.asarray(tensor.data).ravel(), t.data.view(np.uint8).ravel())


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("fixture", ["q4_gguf", "k_gguf"])
def test_weights_read_in_place_are_the_converted_weights_in_engine_order(
    fixture, interleave, request, monkeypatch
):
    """Each layer of each GGUFWeight dequantizes (by the gguf package) to exactly the float
    weight the converted folder gives, in the engine's "out_in" order (QKV fused by KV head,
    Q and K unpermuted, gate then up); norms and the rest are the same arrays. Interleaved,
    the Q4_K runs are laid out 16 rows at a time and hold the same values (Q4_1, Q4_0 and
    Q8_0 stay as the file has them)."""
    path, folder = request.getfixturevalue(fixture)
    assert source_gguf(str(path), folder) == path
    config, floats = converted(folder)
    monkeypatch.setattr(gguf_weights, "_INTERLEAVE_ROWS", 16)  # a tile at a time
    params, kept = load_gguf_params(path, config, np.float32, interleave)
    assert kept == ALL_BLOCKS
    formats = {int(f) for n in PROJECTIONS for f, rows, _ in params["layers"][n].table[0] if rows}
    x16 = LAYOUTS["Q4_K_X16"][0]
    assert (x16 in formats) == (interleave and fixture == "k_gguf")
    assert LAYOUTS["Q4_K"][0] not in formats or not interleave
    for name in PROJECTIONS:
        w = params["layers"][name]
        assert isinstance(w, GGUFWeight) and w.data.ctypes.data % 64 == 0
        want = np.asarray(floats["layers"][name].w)  # [L, *out, K]
        for layer in range(config.num_hidden_layers):
            got = dequantize_layer(w.data[layer], w.table[layer], w.k)
            np.testing.assert_array_equal(got, want[layer].reshape(got.shape), err_msg=name)
    embed = params["embed"]
    got = dequantize_layer(embed.data[0], embed.table[0], embed.k)
    np.testing.assert_array_equal(got, np.asarray(floats["embed"].w))
    for name in ("input_norm", "post_attention_norm"):
        np.testing.assert_array_equal(params["layers"][name], floats["layers"][name])


def comparison_options(cpu_kernel_dir) -> dict:
    """The engines compared on blocks and on float weights: prompt chunks and decodes of
    three requests, the C++ kernels of the session's builds."""
    return dict(
        max_num_batched_tokens=8,
        token_buckets=(1, 2, 8),
        max_num_seqs=3,
        block_size=8,
        num_kv_blocks=32,
        cache_dir=str(cpu_kernel_dir.parent),  # the session's kernel builds
        compilation_cache=False,
        matmul_impl="cpu",
    )


@needs_compiler
@pytest.mark.parametrize("fixture", ["q4_gguf", "k_gguf"])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_engine_on_blocks_matches_the_engine_on_float_weights(
    fixture, int8_activations, request, cpu_kernel_dir
):
    """Greedy tokens the same and logprobs close: exact activations differ from the float
    weights' products by summation order, int8 ones by their rounding too."""
    path, _ = request.getfixturevalue(fixture)
    options = comparison_options(cpu_kernel_dir)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    runs = {}
    for mode in ("on", "off"):
        extra = {"int8_activations": int8_activations} if mode == "on" else {}
        llm = build_llm(path, None, gguf_weights=mode, **options, **extra)
        assert llm.engine.gguf_weights == (ALL_BLOCKS if mode == "on" else [])
        interleaved = mode == "on" and int8_activations and has_avx512_vnni()
        assert llm.engine.config.resolved.gguf_interleaved == interleaved
        runs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tolerance = 0.05 if int8_activations else 1e-4
    for ours, theirs in zip(runs["on"], runs["off"], strict=True):
        first = theirs.token_ids[0]
        assert ours.token_ids[0] == first
        assert abs(ours.logprobs[0][first] - theirs.logprobs[0][first]) < tolerance
        if not int8_activations:
            assert ours.token_ids == theirs.token_ids


@needs_compiler
def test_speculation_on_blocks_gives_the_tokens_without_it(k_gguf, cpu_kernel_dir):
    """Steps whose padding rows (tokens and sample rows) the block kernel skips: n-gram
    proposals verified in the same steps as prompt chunks and other requests' decodes give the
    greedy tokens of the engine without speculation (exact activations: every row's product
    the same whatever else the step holds but for summation order)."""
    path, _ = k_gguf
    options = dict(
        max_num_batched_tokens=16,
        token_buckets=(1, 4, 8, 16),
        max_num_seqs=3,
        block_size=8,
        num_kv_blocks=64,
        cache_dir=str(cpu_kernel_dir.parent),
        compilation_cache=False,
        gguf_weights="on",
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], [11, 12, 11, 12, 11], [20, 21, 22, 23]]
    runs = {}
    for method in (None, "ngram"):
        extra = {}
        if method:  # (the rule of thumb: measured times may take no proposal on a CPU)
            extra = dict(speculative_method=method, num_speculative_tokens=3)
            extra["speculative_adaptive"] = False
        llm = build_llm(path, None, **options, **extra)
        runs[method] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if method:
            assert llm.engine.stats().spec.num_accepted_tokens > 0
    assert runs["ngram"] == runs[None]


def test_gguf_weights_on_where_they_cannot_be_kept_is_a_clear_error(
    tiny_model_dir, model_cache_dir
):
    options = dict(cache_dir=str(model_cache_dir), gguf_weights="on")
    with pytest.raises(ValueError, match=r"gguf_weights 'on' cannot be used here: .*matmul"):
        build_llm(tiny_model_dir, None, matmul_impl="xla", **options)
    if can_build():
        with pytest.raises(
            ValueError, match=r"gguf_weights 'on' cannot be used here: .*not converted from a GGUF"
        ):
            build_llm(tiny_model_dir, None, matmul_impl="cpu", **options)
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        build_llm(tiny_model_dir, None, gguf_weights="yes")


@needs_compiler
def test_int4_takes_q4_k_and_q4_0_blocks_as_they_are(k_gguf, cpu_kernel_dir):
    """Under quantization="int4" a k-quant file's Q4_K (and Q4_0) projections are the engine's
    int4 weights: they dequantize bit for bit to the converted float32 weights (so to
    gguf.quants' dequantization), and the engine runs on them close to the float32 one (its
    LM head is int8)."""
    path, folder = k_gguf
    config, out_in = converted(folder)
    kept, rejected = verified_blocks(load_gguf_blocks(path, config), out_in)
    assert sorted(kept["layers"]) == sorted(PROJECTIONS) and rejected == []
    options = dict(
        max_num_batched_tokens=8,
        token_buckets=(1, 2),
        max_num_seqs=2,
        block_size=8,
        num_kv_blocks=32,
        cache_dir=str(cpu_kernel_dir.parent),
        compilation_cache=False,
        matmul_impl="cpu",
    )
    int4 = build_llm(path, None, quantization="int4", **options)
    assert int4.engine.gguf_weights == PROJECTIONS
    weights = layer_weights(int4.engine.runner)
    for name in PROJECTIONS:
        w = weights[name]
        assert isinstance(w, Int4) and w.scale.dtype == (
            np.float16 if name == "down_proj" else np.float32
        )
        got = int4_dequantize(np.asarray(w.qs), np.asarray(w.scale), np.asarray(w.bias))
        want = np.asarray(out_in["layers"][name].w).reshape(got.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)  # +0.0 == -0.0 (Q4_0)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    float32 = build_llm(path, None, **options)
    outputs = (x.generate(prompts, params, use_tqdm=False) for x in (int4, float32))
    for a, b in zip(*outputs, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        # the first token from the same prompt: the same choice, its logprob within the int8
        # head's error (a wrong scale, bias or nibble order moves it by whole nats)
        assert a.token_ids[0] == b.token_ids[0]
        first = a.token_ids[0]
        assert abs(a.logprobs[0][first] - b.logprobs[0][first]) < 0.1

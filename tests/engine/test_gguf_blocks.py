"""GGUF blocks kept beside the float32 weights (jaxinfer.model_loader.gguf_blocks,
jaxinfer.layers.weights.GGUFBlocks): the tensor table against the gguf package's reader, the blocks in
the engine's row order against the converted weights, and an engine that reads them giving
bit-identical outputs, on a tiny model written as a GGUF file of Q4_1 projections and a Q8_0
embedding (its LM head)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from cpu_kernels.build import can_build
from jaxinfer import SamplingParams
from jaxinfer.config import EngineOptions
from jaxinfer.config.configure import configure
from jaxinfer.layers.linear import OUT_IN
from jaxinfer.layers.weights import Dense, Int4
from jaxinfer.model_loader.gguf_blocks import load_gguf_blocks, verified_blocks
from jaxinfer.model_loader.gguf_tensors import read_tensors
from jaxinfer.model_loader.load import kept_gguf_blocks
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


def test_blocks_reproduce_the_converted_weights_in_engine_order(q4_gguf):
    path, folder = q4_gguf
    assert source_gguf(str(path), folder) == path
    config, params = converted(folder)
    blocks = load_gguf_blocks(path, config)
    kept, rejected = verified_blocks(blocks, params)
    assert rejected == [] and [*kept["layers"], *kept.keys() - {"layers"}] == ALL_BLOCKS
    assert {w.fmt for w in kept["layers"].values()} == {"Q4_1"} and kept["embed"].fmt == "Q8_0"
    layers = config.num_hidden_layers
    assert kept["layers"]["gate_up_proj"].qs.shape == (layers, 2 * 128, 64 // 2)


@pytest.mark.parametrize("name", ["qkv_proj", "down_proj"])
def test_blocks_that_differ_from_the_weights_are_not_kept(q4_gguf, name):
    path, folder = q4_gguf
    config, params = converted(folder)
    layer = np.array(params["layers"][name].w)
    layer[1].reshape(-1)[5] += 1e-3  # one value of layer 1
    params["layers"] = {**params["layers"], name: Dense(layer, -1)}
    kept, rejected = verified_blocks(load_gguf_blocks(path, config), params)
    assert rejected == [name] and name not in kept["layers"]


@needs_compiler
def test_engine_with_gguf_weights_gives_bit_identical_outputs(q4_gguf, cpu_kernel_dir):
    path, _ = q4_gguf
    options = dict(
        max_num_batched_tokens=8,
        token_buckets=(1, 2),  # steps of 1-2 tokens read the blocks, of 8 the weights
        max_num_seqs=3,
        block_size=8,
        num_kv_blocks=32,
        cache_dir=str(cpu_kernel_dir.parent),  # the session's kernel builds
        compilation_cache=False,
        matmul_impl="cpu",
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    results = {}
    for mode in ("on", "off"):
        llm = build_llm(path, None, gguf_weights=mode, **options)
        assert llm.engine.gguf_weights == (ALL_BLOCKS if mode == "on" else [])
        outputs = llm.generate(prompts[:1], params, use_tqdm=False)
        outputs += llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert results["on"] == results["off"]


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


def test_another_models_gguf_keeps_no_blocks(q4_gguf, tiny_model_dir):
    """The blocks of a GGUF that is not the loaded model's (here: another tiny model's) are
    never kept: "auto" goes without, "on" is a clear error."""
    path, _ = q4_gguf
    options = EngineOptions(model=str(tiny_model_dir), gguf_weights="off")
    config, _ = configure(options, tiny_model_dir)
    params = load_llama_params(tiny_model_dir, config.model.arch, np.float32)
    assert kept_gguf_blocks(path, config, params, required=False) is None
    with pytest.raises(ValueError, match=r"gguf_weights 'on': no GGUF blocks can be kept"):
        kept_gguf_blocks(path, config, params, required=True)


@needs_compiler
def test_int4_takes_q4_k_and_q4_0_blocks_as_they_are(k_gguf, cpu_kernel_dir):
    """Under quantization="int4" a k-quant file's Q4_K (and Q4_0) projections are the engine's
    int4 weights: they dequantize bit for bit to the converted float32 weights (so to
    gguf.quants' dequantization), and the engine runs on them close to the float32 one (its
    LM head is int8)."""
    path, folder = k_gguf
    config, out_in = converted(folder)
    kept, rejected = verified_blocks(load_gguf_blocks(path, config, int4=True), out_in)
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

"""Tensor parallelism over 8 virtual CPU devices: the same tokens and logits as one device,
every sharded weight split 1/tp per device, and Orbax checkpoints restored into shards."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.model_loader.model_cache import resolve_model
from jaxinfer.model_loader.orbax_checkpoint import convert
from jaxinfer.parallel.distributed import DistributedConfig
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.tokenizer import TokenizerWrapper
from tests.support.engines import PRESETS, build_llm
from tests.support.parity import Harness, assert_close

pytestmark = pytest.mark.engine

OPTIONS = PRESETS["tiny"]
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):", "Zwölf Boxkämpfer"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def tokens_and_logprobs(outputs) -> tuple[list[list[int]], np.ndarray]:
    """Each completion's tokens, and the logprob of every sampled token (flattened)."""
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        lp[t]
        for o in outputs
        for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
    ]
    return tokens, np.array(logprobs)


def completions(llm: LLM):
    return tokens_and_logprobs(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def single(tiny_llm):
    return completions(tiny_llm)


def shard_shape(array) -> tuple[int, ...]:
    """The shape of each device's part of an array (of a float weight's array)."""
    array = getattr(array, "w", array)
    shapes = {tuple(s.data.shape) for s in array.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the tiny model's 2 KV heads: they are copied
def test_tiny_model_split_gives_the_same_tokens_and_shards(tiny_model_dir, single, tp):
    llm = build_llm(tiny_model_dir, None, tensor_parallel_size=tp, **OPTIONS)
    tokens, logprobs = completions(llm)
    assert tokens == single[0]
    np.testing.assert_allclose(logprobs, single[1], rtol=1e-4, atol=1e-5)

    runner = llm.engine.runner
    assert runner.partitioner.size == tp
    layer = runner.layer_params[0]  # per-layer execution on CPU
    heads, kv_heads, head_dim = 4, max(2, tp), 16  # the model's view (KV heads copied)
    hidden, inter, vocab = 64, 112, 320
    assert runner.kernels.weight_layout == "out_in"  # the CPU default: [out, in]
    expected = {
        "qkv_proj": (kv_heads // tp, heads // kv_heads + 2, head_dim, hidden),
        "o_proj": (hidden, heads * head_dim // tp),
        "gate_up_proj": (2, inter // tp, hidden),
        "down_proj": (hidden, inter // tp),
        "input_norm": (hidden,),  # replicated
    }
    for name, shape in expected.items():
        assert shard_shape(layer[name]) == shape, name
        assert len(getattr(layer[name], "w", layer[name]).sharding.device_set) == tp
    assert shard_shape(runner.top_params["embed"]) == (vocab // tp, hidden)
    assert shard_shape(runner.top_params["lm_head"]) == (vocab // tp, hidden)
    assert shard_shape(runner.kv_cache.values)[4] == kv_heads // tp


@pytest.mark.parametrize(
    ("layer_execution", "weight_layout"), [("scan", "in_out"), ("per_layer", "out_in")]
)
def test_split_logits_match_one_device_and_hf(tiny_model_dir, layer_execution, weight_layout):
    """Chunked prefill and a mixed batch, logits to 1e-4 relative error."""
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 320, size=n)) for n in (23, 9)]
    results = {}
    for tp in (1, 2):
        harness = Harness(tiny_model_dir, layer_execution, tp, weight_layout)
        a, b = (harness.new_request(f"r{i}", p) for i, p in enumerate(prompts))
        first = harness.step([(a, 11), (b, 9)])
        second = harness.step([(a, 12)])
        results[tp] = np.concatenate([first, second])
        if tp == 2:
            reference = harness.reference(prompts[0])
            assert_close(second[0], reference[22])
    assert_close(results[2], results[1])


@pytest.mark.default_model
def test_default_model_split_three_ways(model_cache_dir):
    """SmolLM2-135M (9 query heads, 3 KV heads) over 3 devices: a chat prompt, then HF's
    greedy continuation fed one token at a time. Every step's logits match one device's and
    pick the same greedy token."""
    import torch

    folder = resolve_model(None, model_cache_dir)
    single = Harness(folder, "per_layer")
    split = Harness(folder, "per_layer", tensor_parallel_size=3)
    qkv = split.runner.layer_params[0]["qkv_proj"].w
    assert qkv.shape == (576, 3, 5, 64) and shard_shape(qkv) == (576, 1, 5, 64)
    tokenizer = TokenizerWrapper(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        sequence = single.hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )[0].tolist()
    logits = {}
    for tp, harness in ((1, single), (3, split)):
        request = harness.new_request("chat", sequence)
        steps = [harness.step([(request, len(prompt))])[0]]
        steps += [harness.step([(request, 1)])[0] for _ in range(len(sequence) - len(prompt) - 1)]
        logits[tp] = np.stack(steps)
        assert logits[tp].argmax(-1).tolist() == sequence[len(prompt) :]  # greedy, as HF
    assert_close(logits[3], logits[1])


@pytest.mark.parametrize("tp", [1, 4])
def test_orbax_round_trip(tiny_model_dir, single, tmp_path, tp):
    folder = tmp_path / "orbax_model"
    convert(resolve_model(str(tiny_model_dir), tmp_path), folder, "float32")
    assert (folder / "orbax").is_dir() and not list(folder.glob("*.safetensors"))
    llm = build_llm(folder, None, tensor_parallel_size=tp, **OPTIONS)
    tokens, logprobs = completions(llm)
    assert tokens == single[0]
    np.testing.assert_allclose(logprobs, single[1], rtol=1e-5 if tp == 1 else 1e-4, atol=1e-6)
    if tp == 4:  # restored into shards, KV heads copied on the devices
        assert shard_shape(llm.engine.runner.layer_params[0]["qkv_proj"]) == (
            1,
            3,
            16,
            64,
        )  # out_in


def test_sizes_that_cannot_split_are_clear_errors(tiny_model_dir):
    with pytest.raises(ValueError, match=r"cannot split 4 query heads.*sizes that work: \[1, 2, 4"):
        build_llm(tiny_model_dir, None, tensor_parallel_size=3, **OPTIONS)
    with pytest.raises(ValueError, match="needs 16 devices; JAX sees 8"):
        make_mesh(16)
    with pytest.raises(ValueError, match="does not run under tensor parallelism"):
        build_llm(tiny_model_dir, None, tensor_parallel_size=2, attention_impl="pallas", **OPTIONS)
    with pytest.raises(ValueError, match="go together"):
        DistributedConfig(coordinator_address="10.0.0.1:1234")
    with pytest.raises(ValueError, match="process_id"):
        DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=2)

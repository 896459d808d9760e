"""Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, sliding-window Mistral and Gemma 3 (local and
global layers, sandwich norms, GELU-tanh, a scaled embedding) against Hugging Face
transformers on tiny random models (written by transformers, no downloads).

Per family: logits within 1e-5 relative in float32 for a prompt in one step, in chunks over
shuffled blocks and inside a mixed batch (the CPU default: the C++ matmul, grouped-matmul and
attention kernels under the layer scan; the MoE families also through the references in the
"in_out" layout, as is Gemma 3); greedy generations through the engine equal HF's generate; a checkpoint
whose experts are packed (`experts.gate_up_proj`, the layout of recent transformers) loads to
the same model as one tensor per expert; and a MoE model split over 4 and 8 virtual CPU
devices, by tensor parallelism within the experts or by expert parallelism, generates the
tokens of one device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from tests.support.engines import build_llm
from tests.support.models import FAMILIES, make_family_model
from tests.support.parity import (
    Harness,
    check_prompt_in_chunks_over_shuffled_blocks,
    check_prompt_in_one_step,
    check_prompt_inside_mixed_batch,
)

pytestmark = pytest.mark.engine

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory):
    folders = {}

    def folder(family: str):
        if family not in folders:
            folders[family] = make_family_model(tmp_path_factory.mktemp(family), family)
        return folders[family]

    return folder


EXECUTIONS = {"cpu": ("scan", "out_in"), "reference": ("scan", "in_out")}
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CASES = [(f, "cpu") for f in FAMILIES] + [
    (f, "reference") for f in (*MOE_FAMILIES, "gemma3", "qwen3_5", "qwen3_next")
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{e}" for f, e in CASES])
def harness(request, family_folder):
    family, execution = request.param
    layer_execution, layout = EXECUTIONS[execution]
    if execution == "reference":
        return Harness(family_folder(family), layer_execution, weight_layout=layout)
    from jaxinfer.layers.native_kernels import KernelMatmul

    matmul = KernelMatmul(request.getfixturevalue("cpu_matmul"))
    return Harness(
        family_folder(family),
        layer_execution,
        weight_layout=layout,
        matmul=matmul,
        attention=request.getfixturevalue("cpu_attention"),
    )


RTOL = 1e-5


def test_prompt_in_one_step(harness):
    check_prompt_in_one_step(harness, RTOL)


def test_prompt_in_chunks_over_shuffled_blocks(harness):
    """(Chunk edges inside and across blocks, and across the sliding window.)"""
    check_prompt_in_chunks_over_shuffled_blocks(harness, RTOL)


def test_prompt_inside_mixed_batch(harness):
    check_prompt_inside_mixed_batch(harness, RTOL)


GREEDY_PROMPTS = [[5, 9, 14], list(range(40, 63)), [int(t) for t in np.arange(3, 300, 7)]]


def hf_greedy(folder, prompts, num_tokens: int) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            tokens = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_greedy_generation_matches_hugging_face(harness):
    """The model's greedy tokens, the prompts batched together, equal HF's generate."""
    prompts = {str(i): p for i, p in enumerate(GREEDY_PROMPTS)}
    tokens = harness.greedy(prompts, 12)
    assert list(tokens.values()) == hf_greedy(harness.folder, GREEDY_PROMPTS, 12)


@pytest.mark.parametrize("family", ["qwen3_moe", "mistral_sliding_window", "gemma3"])
def test_engine_generates_hugging_faces_tokens(family, family_folder):
    """Through the whole engine (scheduler, chunked prefill, CPU defaults): a MoE family, and
    the sliding windows, whose prompts outgrow the window: Mistral's on every layer (blocks
    behind it freed) and Gemma 3's on its local layers (none freed: its global layers read
    every block)."""
    from jaxinfer import SamplingParams

    folder = family_folder(family)
    llm = build_llm(folder, "tiny")
    kv = llm.engine.kv_cache_manager
    freed = []  # blocks freed behind the window, per call
    free_outside_window = kv.free_outside_window
    kv.free_outside_window = lambda request: freed.append(free_outside_window(request))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(GREEDY_PROMPTS, params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens == hf_greedy(folder, GREEDY_PROMPTS, 12)
    assert (sum(freed) > 0) == (family == "mistral_sliding_window")
    if family != "qwen3_moe":
        # Blocks behind the window went back to the pool as the requests ran (Mistral), yet
        # stayed prefix-cache hits: the same prompts again hit them and give the same tokens.
        hits = kv.prefix_cache_hits
        again = llm.generate(GREEDY_PROMPTS, params)
        assert kv.prefix_cache_hits > hits
        assert [list(o.outputs[0].token_ids) for o in again] == tokens


def _pack_experts(source, target, prefix: str, names: tuple[str, str, str]):
    """The checkpoint of `source` with each layer's experts packed as recent transformers
    writes them: experts.gate_up_proj [X, 2I, E] (gate rows, then up) and experts.down_proj
    [X, E, I], under `mlp.`."""
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    gate, up, down = names
    out = {}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.{prefix}experts."
        count = len({k.split(".")[5] for k in tensors if k.startswith(p)})
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [
                np.concatenate(
                    [tensors.pop(f"{p}{e}.{gate}.weight"), tensors.pop(f"{p}{e}.{up}.weight")]
                )
                for e in range(count)
            ]
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [tensors.pop(f"{p}{e}.{down}.weight") for e in range(count)]
        )
        router = tensors.pop(f"model.layers.{i}.{prefix}gate.weight")
        out[f"model.layers.{i}.mlp.gate.weight"] = router
    out.update(tensors)
    target.mkdir(exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((source / name).read_bytes())


@pytest.mark.parametrize(
    "family,prefix,names",
    [
        ("mixtral", "block_sparse_moe.", ("w1", "w3", "w2")),
        ("qwen2_moe", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    ],
)
def test_packed_expert_layout_loads_the_same_model(family, prefix, names, family_folder, tmp_path):
    from jaxinfer.model_loader.safetensors_loader import load_llama_params
    from jaxinfer.models.families.hf_config import read_config

    source = family_folder(family)
    _pack_experts(source, tmp_path / "packed", prefix, names)
    config = read_config(source / "config.json")
    per_expert = load_llama_params(source, config, np.float32)
    packed = load_llama_params(tmp_path / "packed", config, np.float32)
    for name in ("router", "experts_gate_up", "experts_down"):
        np.testing.assert_array_equal(packed["layers"][name], per_expert["layers"][name])
    # and transformers reads the packed folder as the same model
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "packed").eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    tokens = torch.tensor([[5, 9, 14, 200, 31]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, reference(tokens).logits)


# A MoE model whose 8 query heads, 8 experts and expert width 32 split over 8 devices.
SPLIT_MODEL = dict(
    num_attention_heads=8, head_dim=8, num_experts=8, moe_intermediate_size=32, num_hidden_layers=2
)
SPLITS = [(4, False), (8, False), (4, True), (8, True)]


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("split_moe"), "qwen3_moe", **SPLIT_MODEL)


@pytest.fixture(scope="module")
def one_device_tokens(split_model):
    harness = Harness(split_model, "per_layer", weight_layout="out_in")
    return harness.greedy(_split_prompts(), 10)


def _split_prompts():
    rng = np.random.default_rng(4)
    return {
        name: list(rng.integers(0, 320, size=n)) for name, n in [("a", 5), ("b", 19), ("c", 31)]
    }


@pytest.mark.parametrize(
    "tp,expert_parallel", SPLITS, ids=[f"{'ep' if e else 'tp'}{n}" for n, e in SPLITS]
)
def test_split_over_devices_generates_one_devices_tokens(
    tp, expert_parallel, split_model, one_device_tokens
):
    harness = Harness(
        split_model,
        "per_layer",
        tensor_parallel_size=tp,
        weight_layout="out_in",
        expert_parallel=expert_parallel,
    )
    # the experts really are split: each device holds 1 / tp of them, or of each one
    gate_up = harness.state["layers"]["experts_gate_up"].get_value().w
    shard = gate_up.addressable_shards[0].data.shape
    axis = 1 if expert_parallel else 3  # [L, X, 2, I, E] ("out_in")
    assert shard[axis] * tp == gate_up.shape[axis]
    assert harness.greedy(_split_prompts(), 10) == one_device_tokens

"""int4 weights through the engine: AWQ and GPTQ checkpoints written here (from the formats'
definitions, no hub) against the float checkpoint of their dequantized weights; int4
quantization at load against float32 (the default model's check is in test_default_model.py);
tensor parallelism keeps each group whole with its rows."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cpu_kernels.build import can_build
from jaxinfer import LLM, SamplingParams
from jaxinfer.layers.weights import Int4
from jaxinfer.model_loader.quantized_checkpoint import AWQ_ORDER, SEQUENTIAL, pack_words
from tests.support.checks import check_logprobs_close
from tests.support.engines import build_llm, layer_weights
from tests.support.models import make_tiny_model

pytestmark = pytest.mark.engine

INT4_ATOL = 0.4  # int4 against float32 on the common prefix (nats; 0.25 measured)

PROMPTS = ["The quick brown fox", "def f(x):", "hello world, how are you"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def zero_point_quantize(w: np.ndarray):
    """AWQ/GPTQ's asymmetric groups of an [N, K] weight: (q u8[N, K], zeros u8[N, K / G],
    scales f16[N, K / G]) with W ~= (q - z) s."""
    groups = w.reshape(w.shape[0], -1, GROUP)
    lo, hi = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    scales = ((hi - lo) / 15).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
    assert zeros.min() >= 1  # (GPTQ v1 stores z - 1)
    q = np.clip(np.rint(groups / s[..., None]) + zeros[..., None], 0, 15).astype(np.uint8)
    return q.reshape(w.shape), zeros, scales


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"float": the tiny model, "dequantized": its projections replaced by their quantized
    values, "awq" / "gptq" / "gptq_v2": those same values in each format}."""
    root = tmp_path_factory.mktemp("int4_models")
    source = make_tiny_model(root / "float", intermediate_size=128)
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    folders = {"float": source}
    formats = {"dequantized": {}, "awq": {}, "gptq": {}, "gptq_v2": {}}
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            for out in formats.values():
                out[name] = w
            continue
        prefix = name[: -len("weight")]
        q, zeros, scales = zero_point_quantize(w.astype(np.float32))
        s = np.repeat(scales.astype(np.float32), GROUP, axis=1)
        z = np.repeat(zeros.astype(np.float32), GROUP, axis=1)
        formats["dequantized"][name] = ((q - z) * s).astype(np.float32)
        formats["awq"].update(
            {
                prefix + "qweight": pack_words(q.T, AWQ_ORDER, 1),  # [K, N / 8]
                prefix + "qzeros": pack_words(zeros.T, AWQ_ORDER, 1),  # [K / G, N / 8]
                prefix + "scales": np.ascontiguousarray(scales.T),  # [K / G, N]
            }
        )
        for fmt, offset in (("gptq", 1), ("gptq_v2", 0)):
            formats[fmt].update(
                {
                    prefix + "qweight": pack_words(q.T, SEQUENTIAL, 0),  # [K / 8, N]
                    # v1 stores z - 1 in 4 bits (a zero point of 0 would read back as 16,
                    # as AutoGPTQ reads it; the tiny model's groups all straddle 0)
                    prefix + "qzeros": pack_words((zeros.T - offset) & 0xF, SEQUENTIAL, 1),
                    prefix + "scales": np.ascontiguousarray(scales.T),
                    prefix + "g_idx": (np.arange(w.shape[1]) // GROUP).astype(np.int32),
                }
            )
    quantization = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False},
        "gptq_v2": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "checkpoint_format": "gptq_v2",
        },
    }
    for fmt, out in formats.items():
        folder = root / fmt
        shutil.copytree(source, folder)
        (folder / "model.safetensors").unlink()
        save_file(out, str(folder / "model.safetensors"))
        if fmt in quantization:
            (folder / "config.json").write_text(
                json.dumps({**config, "quantization_config": quantization[fmt]})
            )
        folders[fmt] = folder
    return folders


def generate(llm: LLM):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def float_outputs(checkpoints):
    return generate(build_llm(checkpoints["float"], "tiny"))


@pytest.fixture(scope="module")
def dequantized_outputs(checkpoints):
    return generate(build_llm(checkpoints["dequantized"], "tiny"))


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_v2"])
def test_quantized_checkpoint_matches_its_dequantized_weights(
    checkpoints, dequantized_outputs, fmt
):
    llm = build_llm(checkpoints[fmt], "tiny")
    assert llm.engine.config.resolved.weight_format == f"{fmt[:4]} int4 (groups of {GROUP})"
    gate_up = layer_weights(llm.engine.runner)["gate_up_proj"]
    assert isinstance(gate_up, Int4) and gate_up.group_size == GROUP
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        generate(llm), dequantized_outputs, strict=True
    ):
        assert tokens == want_tokens
        for ours, theirs in zip(logprobs, want_logprobs, strict=True):
            assert ours.keys() == theirs.keys()
            for token, value in ours.items():
                assert abs(value - theirs[token]) < 2e-4


def test_quantized_checkpoint_refusals(checkpoints, tmp_path):
    folder = tmp_path / "actorder"
    shutil.copytree(checkpoints["gptq"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="desc_act"):
        build_llm(folder, "tiny")
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bitsandbytes"):
        build_llm(folder, "tiny")
    with pytest.raises(ValueError, match="int8"):
        build_llm(checkpoints["awq"], "tiny", quantization="int8")


@pytest.mark.parametrize(
    "options",
    [
        {},  # the CPU default: the C++ kernel, the layers under a scan
        {"int8_activations": True},  # llama.cpp's approach in the C++ kernel
        {"matmul_impl": "xla"},  # the reference: dequantize, then XLA's dot
        {"tensor_parallel_size": 2},
    ],
    ids=["cpu_kernel", "int8_activations", "reference", "tp2"],
)
def test_int4_engine_stays_logprob_close_to_float32(checkpoints, float_outputs, options):
    if "matmul_impl" not in options and "tensor_parallel_size" not in options and not can_build():
        pytest.skip("no C++ compiler to build the matmul kernel")
    folder = str(checkpoints["float"])
    llm = build_llm(folder, "tiny", quantization="int4", **options)
    resolved = llm.engine.config.resolved
    assert resolved.weight_format == "int4 (groups of 32)"
    kernel = options in ({}, {"int8_activations": True})  # the C++ kernel where it runs
    assert resolved.int4_matmul == ("cpu" if kernel else "reference")
    weights = layer_weights(llm.engine.runner)
    assert isinstance(weights["down_proj"], Int4)
    if options.get("tensor_parallel_size") == 2:
        # down's rows split over the devices: each holds whole groups (2 of its 4) with them
        for name in ("qs", "scale", "bias"):
            shards = getattr(weights["down_proj"], name).addressable_shards
            assert len({s.device for s in shards}) == 2
            assert all(
                s.data.shape[-1] * 2 == getattr(weights["down_proj"], name).shape[-1]
                for s in shards
            )
    for i, (ours, theirs) in enumerate(zip(generate(llm), float_outputs, strict=True)):
        largest = check_logprobs_close(ours, theirs, f"prompt {i}", atol=INT4_ATOL)
        print(f"{i}: largest logprob difference {largest:.2e}")


def test_int4_options_refused_where_they_cannot_apply(checkpoints, tiny_model_dir):
    with pytest.raises(ValueError, match="int8_activations"):
        build_llm(checkpoints["float"], "tiny", int8_activations=True)
    with pytest.raises(ValueError, match="quantization_group_size"):
        build_llm(checkpoints["float"], None, quantization="int4", quantization_group_size=48)
    # the tiny model's FFN width (112) is no multiple of 32: its down projection cannot be grouped
    with pytest.raises(ValueError, match="K=112"):
        build_llm(tiny_model_dir, "tiny", quantization="int4")
    assert jax.device_count() >= 2


def test_int4_mixture_of_experts_engine(tmp_path):
    """A Qwen3-MoE model with int4 experts (the router stays float) through the whole engine,
    the experts' products in the C++ grouped int4 kernel, against the float model."""
    from tests.support.models import make_family_model

    folder = str(make_family_model(tmp_path / "qwen3_moe", "qwen3_moe"))
    llm = build_llm(folder, "tiny", quantization="int4")
    weights = layer_weights(llm.engine.runner)
    assert isinstance(weights["experts_gate_up"], Int4)
    assert not isinstance(weights["router"], Int4)
    want = generate(build_llm(folder, "tiny"))
    for i, (ours, theirs) in enumerate(zip(generate(llm), want, strict=True)):
        largest = check_logprobs_close(ours, theirs, f"prompt {i}", atol=INT4_ATOL)
        print(f"{i}: largest logprob difference {largest:.2e}")

"""Loading Hugging Face folders: sharded checkpoints, dtypes, and clear errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxinfer.model_loader.safetensors_loader import checkpoint_files, load_llama_params
from jaxinfer.models.families.hf_config import config_from_dict, read_config
from tests.support.models import make_tiny_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def single_file(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("single"))


def flat(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_sharded_checkpoint_loads_like_single_file(single_file, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(single_file)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(checkpoint_files(tmp_path)) > 2
    config = read_config(single_file / "config.json")
    sharded = flat(load_llama_params(tmp_path, config, np.float32))
    single = flat(load_llama_params(single_file, config, np.float32))
    assert sharded.keys() == single.keys()
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name], err_msg=name)


def test_bfloat16_checkpoint_loads_into_float32_and_back(single_file, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(single_file, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = read_config(tmp_path / "config.json")
    as_f32 = flat(load_llama_params(tmp_path, config, np.float32))
    as_bf16 = flat(load_llama_params(tmp_path, config, np.dtype(jnp.bfloat16)))
    reference = flat(load_llama_params(single_file, config, np.float32))
    for name, value in as_f32.items():
        assert value.dtype == np.float32 and as_bf16[name].dtype == jnp.bfloat16
        np.testing.assert_allclose(value, reference[name], rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(as_bf16[name].astype(np.float32), value)


def test_shape_mismatch_names_file_tensor_and_expected_shape(single_file, tmp_path):
    for item in single_file.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = read_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"model\.safetensors.*up_proj.*\(3, 3\).*\(112, 64\)"):
        load_llama_params(tmp_path, config, np.float32)


def test_missing_tensor_and_missing_files(single_file, tmp_path):
    weights = load_file(str(single_file / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = read_config(single_file / "config.json")
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_llama_params(tmp_path, config, np.float32)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_llama_params(empty, config, np.float32)
    (empty / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_llama_params(empty, config, np.float32)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_config(empty / "config.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position"),
        ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "Qwen's sliding"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "different attention types"),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "mlp_only_layers": [0]},
            "dense layers between MoE layers",
        ),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "decoder_sparse_step": 2},
            "dense layers between MoE layers",
        ),
        ({"architectures": ["MixtralForCausalLM"]}, "num_local_experts or num_experts"),
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8},
            "shared_expert_intermediate_size",
        ),
    ],
)
def test_unsupported_configs_are_refused(single_file, change, message):
    config = json.loads((single_file / "config.json").read_text())
    config.update(change)
    with pytest.raises(ValueError, match=message):
        config_from_dict(config)


def test_family_fields_are_read(single_file):
    """Each family's own fields (the architectures' parity with HF is tested in
    test_model_families.py)."""
    base = json.loads((single_file / "config.json").read_text())
    mistral = config_from_dict(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert mistral.sliding_window == 4096 and mistral.moe is None
    assert config_from_dict(base).sliding_window is None  # Llama: no window
    mixtral = config_from_dict(
        {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
    )
    assert mixtral.moe.router.renormalize and mixtral.moe.top_k == 2
    assert mixtral.moe.intermediate_size == base["intermediate_size"]
    qwen3_moe = config_from_dict(
        {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 24,
            "norm_topk_prob": False,
        }
    )
    assert (qwen3_moe.moe.num_experts, qwen3_moe.moe.top_k) == (16, 4)
    assert qwen3_moe.moe.intermediate_size == 24 and not qwen3_moe.moe.router.renormalize
    assert qwen3_moe.qk_norm == "head" and qwen3_moe.dense_intermediate_size == 0
    olmoe = config_from_dict(
        {**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 8, "clip_qkv": 8.0}
    )
    assert olmoe.qk_norm == "all" and olmoe.clip_qkv == 8.0

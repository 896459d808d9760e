"""GGUF files of every family with a GGUF architecture, written from tiny random Hugging Face
models the way llama.cpp's converter writes them (tests.support.gguf), convert back to the
same model: the same config and, tensor for tensor, the same parameters as the loader reads
from the Hugging Face folder. transformers reading the same GGUF files (where it reads the
family) gives the original model's logits, which checks the files against a reader not
written here. Each family's outputs against transformers are tested in test_model_families.py."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.model_loader.model_cache import resolve_model
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.families import family_for_gguf
from jaxinfer.models.families.family import GGUFMetadata
from jaxinfer.models.families.hf_config import read_config
from tests.support.gguf import write_gguf
from tests.support.models import make_family_model, make_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gemma3")
# the families whose GGUF files transformers reads (not Mixtral's nor OLMoE's)
READ_BY_TRANSFORMERS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma3")


def _hf_folder(family, folder):
    if family == "llama":
        return make_tiny_model(folder, num_key_value_heads=2)
    if family == "qwen2":
        return make_tiny_model(folder, architecture="qwen2", num_key_value_heads=1)
    if family == "gemma3":  # what a GGUF file can say: llama.cpp's pattern and scale
        return make_family_model(
            folder, family, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32
        )
    return make_family_model(folder, family)


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    family = request.param
    hf = _hf_folder(family, tmp_path_factory.mktemp(family))
    path = tmp_path_factory.mktemp("gguf") / f"{family}.gguf"
    write_gguf(hf, path, quantized={})
    folder = resolve_model(str(path), tmp_path_factory.mktemp("cache"))
    return family, hf, path, folder


def test_config_is_the_families(converted):
    _, hf, _, folder = converted
    ours, theirs = read_config(folder / "config.json"), read_config(hf / "config.json")
    # the file keeps eps as a float32
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs


def test_parameters_are_the_loaders(converted):
    _, hf, _, folder = converted
    config = read_config(hf / "config.json")
    ours = load_llama_params(folder, config, np.float32)
    theirs = load_llama_params(hf, config, np.float32)
    flat_ours = dict(_flatten(ours))
    flat_theirs = dict(_flatten(theirs))
    assert flat_ours.keys() == flat_theirs.keys()
    for name, value in flat_theirs.items():
        np.testing.assert_array_equal(flat_ours[name], value, err_msg=name)


@pytest.mark.parametrize("converted", READ_BY_TRANSFORMERS, indirect=True)
def test_transformers_reads_the_file_as_the_model(converted):
    _, hf, path, _ = converted
    original = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    # (its config from the folder: transformers' GGUF mapping misses some families' keys,
    # Qwen3's head size among them; the weights come from the file)
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=original.config, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[5, 17, 99, 42, 7, 250, 3, 64]])
    with torch.no_grad():
        expected, actual = original(ids).logits, from_gguf(ids).logits
    np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)


def test_an_unknown_architecture_is_a_clear_error():
    meta = GGUFMetadata({"general.architecture": "mamba"}, "x.gguf")
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported"):
        family_for_gguf(meta)


def test_an_unreadable_block_type_is_a_clear_error(tmp_path):
    hf = make_tiny_model(tmp_path / "hf")
    path = tmp_path / "iq.gguf"
    write_gguf(hf, path, quantized={"mlp.down_proj.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(ValueError, match="Q8_1, a block type that cannot be read"):
        resolve_model(str(path), tmp_path / "cache")


def _flatten(tree, prefix=""):
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}.")
        else:
            yield prefix + name, np.asarray(value)

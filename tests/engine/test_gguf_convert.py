"""The GGUF converter and the model cache, on a tiny GGUF written here the way llama.cpp does."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from jaxinfer import SamplingParams
from jaxinfer.model_loader.gguf_convert import unpermute_qk
from jaxinfer.model_loader.model_cache import (
    MANIFEST,
    ensure_folder,
    gguf_folder,
    is_complete,
    resolve_model,
)
from tests.support.engines import build_llm
from tests.support.gguf import NUM_KV_HEADS, llama_cpp_permute, write_gguf
from tests.support.models import make_tiny_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf_folder = make_tiny_model(tmp_path_factory.mktemp("hf"), num_key_value_heads=NUM_KV_HEADS)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    expected = write_gguf(hf_folder, path)
    return hf_folder, path, expected


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.random.default_rng(0).standard_normal((8 * 6, 5)).astype(np.float32)
    for heads in (1, 2, 4, 8):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(weight, heads), heads), weight)
    assert not np.array_equal(llama_cpp_permute(weight, 4), weight)


def test_conversion_recovers_weights_config_and_tokenizer(tiny_gguf, tmp_path):
    hf_folder, path, expected = tiny_gguf
    folder = resolve_model(str(path), tmp_path)
    assert is_complete(folder)
    converted = load_file(str(folder / "model.safetensors"))
    assert set(converted) == set(expected)
    for name, weight in expected.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], weight, err_msg=name)

    config = json.loads((folder / "config.json").read_text())
    original = json.loads((hf_folder / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert config[key] == original[key], key
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False

    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    text = "<|im_start|>user\nThe quick brown fox, 1234 ünïcödé!<|im_end|>"
    assert ours.encode(text).ids == reference.encode(text).ids
    generation = json.loads((folder / "generation_config.json").read_text())
    assert 2 in generation["eos_token_id"]  # <|im_end|> and the GGUF eos


def test_gguf_path_generates_like_the_original_folder(tiny_gguf, tmp_path):
    hf_folder, path, _ = tiny_gguf
    # Its own cache folder (the conversion is the subject); XLA's ops and the reference
    # attention, so the engines do not build the C++ kernels into it.
    options = dict(
        max_num_batched_tokens=16,
        token_buckets=(2,),
        max_num_seqs=2,  # one prompt: fewer sampler programs to compile
        block_size=8,
        num_kv_blocks=32,
        cache_dir=str(tmp_path),
        matmul_impl="xla",
        attention_impl="reference",
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    from_gguf = build_llm(path, None, **options).generate([[5, 6, 7, 8]], params, use_tqdm=False)
    # The original folder differs only by Q8_0 rounding of two tensors: same greedy tokens.
    from_hf = build_llm(hf_folder, None, **options).generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert len(from_gguf[0].outputs[0].token_ids) == 6
    assert from_gguf[0].outputs[0].token_ids == from_hf[0].outputs[0].token_ids


def test_corrupt_or_partial_cache_is_rebuilt(tiny_gguf, tmp_path):
    _, path, _ = tiny_gguf
    folder = gguf_folder(path, tmp_path)
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert gguf_folder(path, tmp_path) == folder and weights.stat().st_mtime_ns == stamp  # reused

    with weights.open("r+b") as f:  # same size, one flipped byte
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not is_complete(folder)
    assert gguf_folder(path, tmp_path) == folder and is_complete(folder)

    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    assert not is_complete(folder)
    gguf_folder(path, tmp_path)
    assert is_complete(folder)

    (folder / MANIFEST).unlink()  # interrupted before the manifest was written
    assert not is_complete(folder)
    gguf_folder(path, tmp_path)
    assert is_complete(folder)


def test_processes_building_one_folder_build_it_once_and_never_remove_it(tmp_path):
    """Two servers started together used to both build, the second deleting the complete
    folder the first was loading. The folder lock serializes them and the one that waited
    finds the folder complete (flock locks conflict between threads' own opens too)."""
    target = tmp_path / "models" / "m"
    builds = []

    def build(out):
        builds.append(threading.current_thread().name)
        time.sleep(0.3)
        (out / "weights.bin").write_bytes(b"w" * 1000)

    threads = [threading.Thread(target=ensure_folder, args=(target, build)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and is_complete(target)
    inode = (target / "weights.bin").stat().st_ino
    ensure_folder(target, build)  # complete: kept as it is
    assert len(builds) == 1 and (target / "weights.bin").stat().st_ino == inode
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no staging


def test_bad_model_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path), tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"xx")
    with pytest.raises(ValueError, match=r"expected a folder or a \.gguf"):
        resolve_model(str(not_gguf), tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        resolve_model(str(fake), tmp_path / "cache")

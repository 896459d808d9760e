"""DeepSeek-V4's multi-token-prediction layer (jaxinfer.models.deepseek_v4_mtp) against a
reference built from transformers' own DeepSeek-V4 modules. Transformers drops the
checkpoint's `mtp.*` tensors, so the reference composes what vLLM's
DeepSeekV4MultiTokenPredictorLayer does from them: a tiny random model of one layer more than
the checkpoint's, whose last layer (a sliding-attention one) is written as `mtp.0.*` beside
random MTP-only tensors; the model's streams before that layer are the checkpoint's streams
before its final collapse, and HF's layer module, its hyper-head and RMSNorm modules and LM
head give the MTP's logits at every position (1e-5 relative), whole and in chunks over
shuffled window blocks (the MTP's own window store carried between them)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.layers.compressed_cache import CompressedCache, allocate
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.model_loader.safetensors_loader import load_llama_params, load_mtp_params
from jaxinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from jaxinfer.models.deepseek_v4_mtp import mtp_logits, mtp_streams
from jaxinfer.models.families.hf_config import read_config
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.params import as_weights
from tests.support.deepseek_v4 import LAYER_TYPES, random_model

pytestmark = pytest.mark.engine

BLOCK = 4  # positions per window block
LENGTH = 30  # past the tiny model's window of 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, HF's MTP logits f32[LENGTH, V], the model's streams before the MTP layer
    f32[LENGTH, N, E], the tokens i32[LENGTH + 1]: the prompt, then the one after it)."""
    import safetensors.torch
    import transformers

    whole = tmp_path_factory.mktemp("deepseek_v4_mtp_whole")
    folder = tmp_path_factory.mktemp("deepseek_v4_mtp")
    last = len(LAYER_TYPES)  # the MTP layer's index in the larger model
    model = random_model((*LAYER_TYPES, "sliding_attention"), seed=3)
    model.save_pretrained(whole)
    config = model.config
    # the checkpoint: the larger model's tensors, its last layer's as mtp.0.*
    tensors = safetensors.torch.load_file(whole / "model.safetensors")
    own = re.compile(rf"^(model\.)?layers\.{last}\.")
    written = {own.sub("mtp.0.", n): t for n, t in tensors.items()}
    assert sum(n.startswith("mtp.0.") for n in written) > 20
    E, N = config.hidden_size, config.hc_mult
    generator = torch.Generator().manual_seed(4)

    def draw(*shape, around=0.0, scale=0.3):
        return around + scale * torch.randn(shape, generator=generator)

    mtp = {
        "enorm.weight": draw(E, around=1.0, scale=0.2),
        "hnorm.weight": draw(E, around=1.0, scale=0.2),
        "norm.weight": draw(E, around=1.0, scale=0.2),
        "e_proj.weight": draw(E, E),
        "h_proj.weight": draw(E, E),
        "hc_head_fn": draw(N, N * E),
        "hc_head_base": draw(N),
        "hc_head_scale": draw(1, around=1.0, scale=0.2),
    }
    written |= {"mtp.0." + n: t for n, t in mtp.items()}
    safetensors.torch.save_file(written, folder / "model.safetensors")
    transformers.DeepseekV4Config(
        **{
            **config.to_dict(),
            "num_hidden_layers": last,
            "layer_types": config.layer_types[:last],
            "mlp_layer_types": config.mlp_layer_types[:last],
        }
    ).save_pretrained(folder)

    # HF: the streams into the last layer (the checkpoint's before its collapse) and the
    # layer's other arguments, from one pass of the larger model
    seen = {}

    def capture(_, args, kwargs):
        seen["streams"], seen["kwargs"] = args[0], kwargs

    layer = model.model.layers[last]
    hook = layer.register_forward_pre_hook(capture, with_kwargs=True)
    rng = np.random.default_rng(5)
    tokens = torch.tensor(rng.integers(0, config.vocab_size, LENGTH + 1))
    with torch.no_grad():
        model(tokens[None, :LENGTH], use_cache=False)
        hook.remove()
        previous = seen["streams"]  # [1, S, N, E]

        def norm(x, weight):
            module = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm(
                E, eps=config.rms_norm_eps
            )
            module.weight.copy_(weight)
            return module(x)

        embedded = model.model.embed_tokens(tokens[None, 1:])  # the token after each position
        embedded[:, 0] = 0  # (position 0's, as vLLM's)
        x = norm(previous, mtp["hnorm.weight"]) @ mtp["h_proj.weight"].T + (
            norm(embedded, mtp["enorm.weight"]) @ mtp["e_proj.weight"].T
        ).unsqueeze(-2)
        streams = layer(x, **seen["kwargs"])
        head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(config)
        head.hc_fn.copy_(mtp["hc_head_fn"])
        head.hc_base.copy_(mtp["hc_head_base"])
        head.hc_scale.copy_(mtp["hc_head_scale"])
        logits = model.lm_head(norm(head(streams), mtp["norm.weight"]))
    return folder, logits[0].numpy(), previous[0].numpy(), tokens.numpy().astype(np.int32)


def test_without_mtp_tensors_there_is_no_mtp_layer(tmp_path):
    folder = tmp_path / "plain"
    random_model(LAYER_TYPES[:2]).save_pretrained(folder)
    config = read_config(folder / "config.json")
    assert load_mtp_params(folder, config, np.float32) is None


@pytest.mark.parametrize("chunks", [(LENGTH,), (11, 7, 12)], ids=["whole", "chunked"])
def test_mtp_logits_match_the_reference(checkpoint, chunks):
    folder, expected, previous, tokens = checkpoint
    config, mtp, params = loaded(folder)
    kernels = ModelKernels()  # (the references)
    blocks = -(-LENGTH // BLOCK)
    table = np.random.default_rng(6).permutation(np.arange(1, 2 * blocks))[:blocks]
    cache = CompressedCache(
        window=jnp.zeros((1, 2 * blocks, BLOCK, config.head_dim)),
        entries={},
        states={},
        entry_columns=(),
    )

    @jax.jit
    def step(cache, batch, previous):
        cache, streams = mtp_streams(
            config, mtp, params["embed"], cache, batch, previous, kernels=kernels
        )
        return cache, mtp_logits(config, mtp, params, streams, kernels)

    start = 0
    for size in chunks:
        at = np.arange(start, start + size)
        cache, logits = step(cache, batch_of(tokens[1:], at, table[None]), previous[at])
        want = expected[at]
        np.testing.assert_allclose(
            np.asarray(logits), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )
        start += size


def test_the_models_streams_are_what_it_takes(checkpoint):
    """The model's streams before its final collapse (DeepseekV4ForCausalLM.streams) are
    HF's, and the MTP layer on them gives the reference's logits."""
    folder, expected, previous, tokens = checkpoint
    config, mtp, params = loaded(folder)
    model = DeepseekV4ForCausalLM(config, params)
    kernels = ModelKernels()
    cache = allocate(config, 16, BLOCK, {"csa": 8, "hca": 8}, num_slots=1, max_model_len=32)
    # the window's 8 blocks (of its pool's 16), then each store's (of its own pool's 8)
    stores = [np.arange(1, 1 + end - begin) for _, begin, end in cache.entry_columns]
    row = np.concatenate([np.arange(1, 9), *stores])
    at = np.arange(LENGTH)
    batch = batch_of(tokens, at, row[None])
    mtp_cache = CompressedCache(jnp.zeros((1, 16, BLOCK, config.head_dim)), {}, {}, ())

    @jax.jit
    def run(cache, mtp_cache, batch, next_batch):
        cache, streams = model.streams(cache, batch, kernels=kernels)
        mtp_cache, out = mtp_streams(
            config, mtp, params["embed"], mtp_cache, next_batch, streams, kernels=kernels
        )
        return streams, mtp_logits(config, mtp, params, out, kernels)

    streams, logits = run(cache, mtp_cache, batch, batch_of(tokens[1:], at, row[None]))
    np.testing.assert_allclose(
        np.asarray(streams), previous, rtol=1e-5, atol=1e-5 * np.abs(previous).max()
    )
    np.testing.assert_allclose(
        np.asarray(logits), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max()
    )


def loaded(folder):
    """(the config, the MTP layer's parameters, the model's), on the device."""
    config = read_config(folder / "config.json")
    mtp = jax.tree.map(jnp.asarray, load_mtp_params(folder, config, np.float32))
    params = as_weights(config, load_llama_params(folder, config, np.float32))
    return config, mtp, jax.tree.map(jnp.asarray, params)


def batch_of(tokens: np.ndarray, at: np.ndarray, table: np.ndarray) -> BatchInputs:
    """One request's tokens at positions `at` (its block table `table` [1, MB]), a step."""
    return BatchInputs(
        token_ids=tokens[at].astype(np.int32),
        positions=at.astype(np.int32),
        slot_mapping=(table[0][at // BLOCK] * BLOCK + at % BLOCK).astype(np.int32),
        block_tables=table.astype(np.int32),
        seq_lens=np.asarray([at[-1] + 1], np.int32),
        query_start_loc=np.asarray([0, len(at)], np.int32),
        logits_indices=np.zeros(1, np.int32),
        num_seqs=np.ones(1, np.int32),
        state_rows=np.zeros(1, np.int32),
    )

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

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import SamplingParams
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.layers.compressed_cache import CompressedCache, allocate
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.model_loader.safetensors_loader import load_llama_params, load_mtp_params
from jaxinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from jaxinfer.models.deepseek_v4_mtp import mtp_logits, mtp_streams
from jaxinfer.models.families.hf_config import read_config
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.params import as_weights
from tests.engine.test_model_families import hf_greedy
from tests.support.compiles import counting_compiles
from tests.support.deepseek_v4 import LAYER_TYPES, random_model
from tests.support.engines import build_engine, build_llm
from tests.support.speculative import BIAS, accept_all, homogeneity_pvalue, pairs
from tools.tiny_tokenizer import write_tiny_tokenizer

pytestmark = pytest.mark.engine

BLOCK = 4  # positions per window block
LENGTH = 30  # past the tiny model's window of 8
# Seeds per chi-square sample: half the other methods' tests' (enough here for a verifier that
# keeps every proposal to fall far below the test's bar)
NUM_SAMPLES = 600


class MtpCheckpoint:
    """A checkpoint with an MTP layer, written to `folder`, and HF's reference of it: a random
    model one (sliding) layer longer, whose last layer is the MTP's, beside random MTP-only
    tensors."""

    def __init__(self, folder, whole, exact: bool = False, **overrides):
        """`exact`: every layer's attention and experts write nothing (their output
        projections zero), so the model's next token depends on its current one alone, and
        the MTP layer (h_proj zero, e_proj the identity, enorm ones, its norm the model's)
        computes the same function of the next token: its proposals are the model's
        tokens."""
        import safetensors.torch
        import transformers

        last = len(LAYER_TYPES)  # the MTP layer's index in the larger model
        model = self.model = random_model((*LAYER_TYPES, "sliding_attention"), seed=3, **overrides)
        if exact:
            with torch.no_grad():
                for name, tensor in model.named_parameters():
                    if name.endswith(("o_b_proj.weight", "down_proj", "down_proj.weight")):
                        tensor.zero_()
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

        mtp = self.mtp = {
            "enorm.weight": draw(E, around=1.0, scale=0.2),
            "hnorm.weight": draw(E, around=1.0, scale=0.2),
            "norm.weight": draw(E, around=1.0, scale=0.2),
            "e_proj.weight": draw(E, E),
            "h_proj.weight": draw(E, E),
            "hc_head_fn": draw(N, N * E),
            "hc_head_base": draw(N),
            "hc_head_scale": draw(1, around=1.0, scale=0.2),
        }
        if exact:
            mtp |= {
                "enorm.weight": torch.ones(E),
                "norm.weight": model.model.norm.weight.detach().clone(),
                "e_proj.weight": torch.eye(E),
                "h_proj.weight": torch.zeros(E, E),
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
        self.folder = folder
        self.layer = model.model.layers[last]
        modeling = transformers.models.deepseek_v4.modeling_deepseek_v4
        self.head = modeling.DeepseekV4HyperHead(config)
        with torch.no_grad():
            self.head.hc_fn.copy_(mtp["hc_head_fn"])
            self.head.hc_base.copy_(mtp["hc_head_base"])
            self.head.hc_scale.copy_(mtp["hc_head_scale"])
        self.norm_module = modeling.DeepseekV4RMSNorm(E, eps=config.rms_norm_eps)

    def into_last(self, tokens: torch.Tensor):
        """HF's streams into the larger model's last layer over `tokens` [S] (the checkpoint's
        before its collapse) [1, S, N, E], and the other arguments HF passes that layer."""
        seen = {}

        def capture(_, args, kwargs):
            seen["streams"], seen["kwargs"] = args[0], kwargs

        hook = self.layer.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(tokens[None], use_cache=False)
        finally:
            hook.remove()
        return seen["streams"], seen["kwargs"]

    def norm(self, x, weight):
        with torch.no_grad():
            self.norm_module.weight.copy_(weight)
            return self.norm_module(x)

    def mixed(self, previous, tokens, first: int):
        """The layer's input: `previous` streams [1, S, N, E] and the tokens after them [S],
        at positions from `first` (position 0's embedding zero, as vLLM's)."""
        mtp = self.mtp
        embedded = self.model.model.embed_tokens(tokens[None])
        if first == 0:
            embedded[:, 0] = 0
        return self.norm(previous, mtp["hnorm.weight"]) @ mtp["h_proj.weight"].T + (
            self.norm(embedded, mtp["enorm.weight"]) @ mtp["e_proj.weight"].T
        ).unsqueeze(-2)

    def logits(self, tokens, proposals=()) -> np.ndarray:
        """HF's MTP logits f32[n - 1 + len(proposals), V]: at each position i < n - 1 of
        `tokens` [n] from the model's streams and tokens[i + 1]; then at each further
        position from the layer's own streams at the one before and the proposal given."""
        tokens = torch.tensor(np.asarray(tokens, np.int64))
        n = len(tokens)
        with torch.no_grad():
            previous, kwargs = self.into_last(tokens[: n - 1])
            x = self.mixed(previous, tokens[1:], 0)
            out = self.layer(x, **kwargs)
            logits = [self.lm_logits(out)]
            for j, token in enumerate(proposals):  # at position n - 1 + j
                fed = torch.tensor(np.asarray(proposals[: j + 1], np.int64))
                _, kwargs = self.into_last(torch.cat([tokens[: n - 1], fed]))
                row = self.mixed(out[:, -1:], torch.tensor([int(token)]), n - 1 + j)
                x = torch.cat([x, row], dim=1)
                out = self.layer(x, **kwargs)
                logits.append(self.lm_logits(out[:, -1:]))
        return torch.cat(logits, dim=1)[0].numpy()

    def lm_logits(self, streams):
        return self.model.lm_head(self.norm(self.head(streams), self.mtp["norm.weight"]))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, HF's MTP logits f32[LENGTH, V], the model's streams before the MTP layer
    f32[LENGTH, N, E], the tokens i32[LENGTH + 1]: the prompt, then the one after it)."""
    reference = MtpCheckpoint(
        tmp_path_factory.mktemp("deepseek_v4_mtp"),
        tmp_path_factory.mktemp("deepseek_v4_mtp_whole"),
    )
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, reference.model.config.vocab_size, LENGTH + 1)
    previous, _ = reference.into_last(torch.tensor(tokens[:LENGTH]))
    logits = reference.logits(tokens)
    return reference.folder, logits, previous[0].numpy(), tokens.astype(np.int32)


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


PROMPTS = [list(np.random.default_rng(i).integers(3, 320, size=n)) for i, n in
           enumerate([23, 37, 9, 30])]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An MTP checkpoint with the tiny tokenizer's vocabulary, and HF's greedy tokens of
    PROMPTS."""
    reference = MtpCheckpoint(
        tmp_path_factory.mktemp("deepseek_v4_mtp_served"),
        tmp_path_factory.mktemp("deepseek_v4_mtp_served_whole"),
        vocab_size=320,
    )
    write_tiny_tokenizer(reference.folder, 320)
    return reference, hf_greedy(reference.folder, PROMPTS, 16)


def test_mtp_speculation_gives_hugging_faces_tokens_and_the_layers_proposals(served):
    """Through the engine, under chunked prefill and preemption: the tokens are HF's greedy
    ones, and every proposal the MTP layer made is the reference's argmax: the first from the
    model's streams at the request's last computed position, each further one from the
    layer's own streams and the proposal before it."""
    reference, expected = served
    engine = build_engine(
        reference.folder,
        "tiny_one_bucket",
        num_kv_blocks=10,
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_adaptive=False,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i))
    outputs, made = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        for request in engine.scheduler.running:
            if request.spec_token_ids:
                made.append((list(request.all_token_ids), list(request.spec_token_ids)))
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
    assert engine.stats().num_preemptions > 0, "the small pools must preempt"
    spec = engine.stats().spec
    print(f"proposed {spec.num_draft_tokens}, accepted {spec.num_accepted_tokens}")
    assert len(made) > 10 and any(len(p) > 1 for _, p in made)
    checked = 0
    for tokens, proposals in made:
        logits = reference.logits(tokens, proposals[:-1])[-len(proposals) :]
        top = np.sort(logits, axis=-1)[:, -2:]
        clear = top[:, 1] - top[:, 0] > 1e-3 * np.abs(logits).max()  # (no near-tie)
        assert (logits.argmax(-1) == proposals)[clear].all(), (tokens, proposals)
        checked += clear.sum()
    assert checked > 20


def test_mtp_proposals_that_hold_are_accepted(tmp_path):
    """A checkpoint whose MTP layer predicts the model's tokens (MtpCheckpoint's `exact`):
    nearly every proposal is accepted, several per step, and the tokens are HF's greedy
    ones, under chunked prefill and preemption, with nothing compiled after warm-up; the
    model split over two devices (the MTP layer whole on each)."""
    (tmp_path / "exact").mkdir()
    reference = MtpCheckpoint(tmp_path / "exact", tmp_path / "whole", exact=True, vocab_size=320)
    write_tiny_tokenizer(reference.folder, 320)
    expected = hf_greedy(reference.folder, PROMPTS, 24)
    llm = build_llm(
        reference.folder,
        "tiny_one_bucket",
        tensor_parallel_size=2,
        num_kv_blocks=10,
        speculative_method="mtp",
        num_speculative_tokens=4,
        speculative_adaptive=False,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with counting_compiles() as compiles:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert compiles == [], "the MTP layer's programs compile at warm-up"
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    spec = llm.engine.stats().spec
    print(f"proposed {spec.num_draft_tokens}, accepted {spec.num_accepted_tokens}")
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens > 40
    assert llm.engine.stats().num_preemptions > 0


def test_mtp_sampling_keeps_the_models_distribution(served, monkeypatch):
    """Random rows: the proposals are drawn from the MTP layer's q (with the requests' logit
    bias), kept for the rejection sampler; the (2nd, 3rd) tokens' distribution is the one
    without speculation (chi-square), where a verifier that keeps every proposal is told
    apart."""
    reference, _ = served
    spec = build_llm(
        reference.folder,
        "tiny_one_bucket",
        max_num_seqs=32,
        max_num_batched_tokens=64,
        token_buckets=(64,),
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_adaptive=False,
    )
    # (4 tokens: the 2nd and 3rd are a first and a second proposal's verdicts)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias=BIAS)
    plain = dataclasses.replace(params, num_speculative_tokens=0)  # (no proposals)
    expected = pairs(spec, plain, range(NUM_SAMPLES))
    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "_verify", accept_all)
        biased = pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    assert homogeneity_pvalue(expected, biased) < 1e-6
    before = spec.engine.stats().spec
    got = pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    after = spec.engine.stats().spec
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    pvalue = homogeneity_pvalue(expected, got)
    print(f"p = {pvalue:.3f}; proposed {proposed}, accepted {accepted}")
    assert accepted > NUM_SAMPLES // 4 and proposed > accepted
    assert pvalue > 1e-3


def test_mtp_needs_a_deepseek_v4_checkpoint_with_its_layer(tmp_path, tiny_model_dir):
    plain = tmp_path / "plain"
    random_model(LAYER_TYPES[:2], vocab_size=320).save_pretrained(plain)
    write_tiny_tokenizer(plain, 320)
    mtp = dict(speculative_method="mtp")
    with pytest.raises(ValueError, match="has none"):
        build_llm(tiny_model_dir, "tiny_one_bucket", **mtp)
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        build_llm(plain, "tiny_one_bucket", **mtp)

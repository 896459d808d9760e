"""DeepSeek-V4 (jaxinfer.models.deepseek_v4) against Hugging Face's DeepseekV4ForCausalLM, the
same weights read from the checkpoint transformers writes (DeepSeek's tensor names): a tiny
random model with two layers of each kind (sliding, CSA, HCA) and hash-routed first layers,
prompts long enough that the indexer's top-k drops CSA entries and HCA closes several
windows. The model: whole prompts in one step, and chunks and decodes of two requests over
shuffled window blocks and entry blocks, each step's logits at 1e-5 relative. The engine:
HF's greedy tokens under chunked prefill and preemption, n > 1, and what it reports and
refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cpu_kernels.build import can_build
from jaxinfer import SamplingParams
from jaxinfer.config.compressed import PREFIX_CACHING_OFF
from jaxinfer.layers.compressed_cache import allocate
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from jaxinfer.models.families.hf_config import config_from_dict, read_config
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.llama import lm_head
from jaxinfer.models.params import as_weights
from tests.engine.test_model_families import hf_greedy
from tests.support.deepseek_v4 import LAYER_TYPES, hf_config, random_model
from tests.support.engines import build_llm
from tools.tiny_tokenizer import write_tiny_tokenizer

pytestmark = pytest.mark.engine

BLOCK = 4  # positions per window block, entries per entry block
LENGTHS = (45, 30)  # 11 CSA entries (top 4 kept), 5 HCA windows closed


class Harness:
    def __init__(self, folder, hf, kernels: ModelKernels | None = None, atol: float = 1e-5):
        self.atol = atol  # of the logits' largest magnitude
        self.config = read_config(folder / "config.json")
        params = load_llama_params(folder, self.config, np.float32)
        self.params = jax.tree.map(jnp.asarray, as_weights(self.config, params))
        model = DeepseekV4ForCausalLM(self.config, self.params)
        rng = np.random.default_rng(0)
        self.prompts = [rng.integers(0, self.config.vocab_size, n) for n in LENGTHS]
        with torch.no_grad():
            self.expected = [hf(torch.tensor(p)[None]).logits[0].numpy() for p in self.prompts]
        self.cache = allocate(
            self.config, 32, BLOCK, {"csa": 16, "hca": 16}, num_slots=3, max_model_len=48
        )
        columns = {key: end - start for key, start, end in self.cache.entry_columns}
        assert columns == {"csa": 3, "hca": 2}  # (48 // 4 entries, 48 // 8, in blocks of 4)
        # Each request's blocks, shuffled over the pools (block 0: the padding's): a row holds
        # the window's 12 blocks, then CSA's entry blocks, then HCA's.
        window = rng.permutation(np.arange(1, 32))
        entries = rng.permutation(np.arange(1, 16))
        self.tables = np.asarray(
            [
                [*window[:12], *entries[:3], *entries[6:8]],
                [*window[12:24], *entries[3:6], *entries[8:10]],
            ],
            np.int32,
        )
        kernels = kernels or ModelKernels()  # (the references)
        self.forward = jax.jit(
            lambda cache, batch: model.hidden_states(cache, batch, kernels=kernels)
        )

    def step(self, chunks: list[tuple[int, int, int]]) -> None:
        """Runs (request, start, end) chunks as one step; checks each token's logits."""
        tokens, positions, slots, starts = [], [], [], [0]
        for r, start, end in chunks:
            at = np.arange(start, end)
            tokens += list(self.prompts[r][start:end])
            positions += list(at)
            slots += list(self.tables[r][at // BLOCK] * BLOCK + at % BLOCK)
            starts.append(starts[-1] + end - start)
        pad = 64 - len(tokens)  # a fixed token bucket: padding tokens write block 0
        rows = [r for r, _, _ in chunks] + [2]  # one padding request, in the spare slot
        batch = BatchInputs(
            token_ids=np.asarray(tokens + [0] * pad, np.int32),
            positions=np.asarray(positions + [0] * pad, np.int32),
            slot_mapping=np.asarray(slots + [0] * pad, np.int32),
            block_tables=np.concatenate([self.tables, np.zeros_like(self.tables[:1])])[rows],
            seq_lens=np.asarray([end for _, _, end in chunks] + [0], np.int32),
            query_start_loc=np.asarray([*starts, starts[-1]], np.int32),
            logits_indices=np.zeros(len(rows), np.int32),
            num_seqs=np.asarray([len(chunks)], np.int32),
            state_rows=np.asarray(rows, np.int32),
        )  # fmt: skip
        self.cache, hidden = self.forward(self.cache, batch)
        head = {"norm": self.params["norm"], "lm_head": self.params["lm_head"]}
        logits = np.asarray(lm_head(self.config, head, hidden))
        for i, (r, start, end) in enumerate(chunks):
            want = self.expected[r][start:end]
            got = logits[starts[i] : starts[i + 1]]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=self.atol * np.abs(want).max())


# YaRN on the compressed layers' RoPE (as V4's checkpoints have it): factor 4 over an original
# 16 positions, the attention factor HF derives (0.1 ln 4 + 1) on cos and sin
YARN = {
    "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                 "rope_theta": 160000.0, "partial_rotary_factor": 0.5},
}  # fmt: skip


# V4's own layout: two HCA layers (hash-routed), then CSA and HCA repeating (a scan over the
# periods; the other layouts run layer by layer)
PERIODIC = {
    "layer_types": ["heavily_compressed_attention"] * 2
    + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
    "mlp_layer_types": ["hash_moe"] * 2 + ["moe"] * 6,
}
VARIANTS = {"default": {}, "yarn": {"rope_parameters": YARN}, "periodic": PERIODIC}


@pytest.fixture(scope="module", params=list(VARIANTS))
def harness_parts(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v4")
    overrides = dict(VARIANTS[request.param])
    layer_types = tuple(overrides.pop("layer_types", LAYER_TYPES))
    hf = random_model(layer_types, **overrides)
    hf.save_pretrained(folder)
    return folder, hf


def test_whole_prompts_in_one_step(harness_parts):
    Harness(*harness_parts).step([(0, 0, 45), (1, 0, 30)])


# Windows that close inside a chunk, at its end and across steps; decodes of one token; a
# request alone and beside another, in either order of the step.
CHUNKED_STEPS = (
    [(0, 0, 7), (1, 0, 13)],
    [(0, 7, 8), (1, 13, 16)],
    [(1, 16, 17), (0, 8, 9)],
    [(0, 9, 30)],
    [(1, 17, 29), (0, 30, 31)],
    [(0, 31, 32), (1, 29, 30)],
    [(0, 32, 45)],
)


def test_chunks_and_decodes_over_shuffled_blocks(harness_parts):
    harness = Harness(*harness_parts)
    for chunks in CHUNKED_STEPS:
        harness.step(chunks)


def test_the_cpp_kernels_give_hugging_faces_logits(harness_parts, cpu_compressed):
    """The C++ attention, indexer and compressor (cpu_kernels.compressed_attention) in place
    of the references, over the same steps: within 2e-5 of the logits' range, where the
    references are within 1e-5 (built for the CPU at hand, the kernels' sums run in another
    order on AVX2 than on AVX-512: one logit of 64 was 1.2e-5 of the range off on AVX2)."""
    kernels = ModelKernels(**cpu_compressed._asdict())
    harness = Harness(*harness_parts, kernels=kernels, atol=2e-5)
    for chunks in CHUNKED_STEPS:
        harness.step(chunks)


def test_config_refusals():
    base = hf_config().to_dict() | {"architectures": ["DeepseekV4ForCausalLM"]}
    config_from_dict(base)
    with pytest.raises(ValueError, match="one shared K=V head"):
        config_from_dict(base | {"num_key_value_heads": 2})
    linear = {"main": {**base["rope_parameters"]["main"], "rope_type": "linear"}}
    with pytest.raises(ValueError, match="main RoPE of type 'linear' is not supported"):
        config_from_dict(base | {"rope_parameters": base["rope_parameters"] | linear})
    with pytest.raises(ValueError, match="n_shared_experts 2 is not supported"):
        config_from_dict(base | {"n_shared_experts": 2})


PROMPTS = [list(np.random.default_rng(i).integers(3, 320, size=n)) for i, n in
           enumerate([23, 37, 9, 30, 41, 17])]  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A model with the tiny tokenizer's vocabulary, and HF's greedy tokens of PROMPTS."""
    folder = tmp_path_factory.mktemp("deepseek_v4_served")
    random_model(vocab_size=320).save_pretrained(folder)
    write_tiny_tokenizer(folder, 320)
    return folder, hf_greedy(folder, PROMPTS, 12)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_generates_hugging_faces_tokens_under_chunking_and_preemption(
    served, async_scheduling
):
    folder, expected = served
    # 16 tokens a step (every prompt chunked); 9 window blocks of 8 positions and entry
    # pools for 72 tokens of context, for 4 running requests of up to 53 tokens: requests
    # are preempted and recomputed from their first token
    llm = build_llm(folder, "tiny_one_bucket", num_kv_blocks=10, async_scheduling=async_scheduling)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.engine.stats().num_preemptions > 0, "the small pools must preempt"
    manager = llm.engine.kv_cache_manager
    for pool in [manager.pool, *manager.entry_pools.values()]:
        assert pool.num_free_blocks == pool.num_blocks - 1


def test_n_samples_each_keep_their_own_compressor_state_and_describe(served):
    folder, expected = served
    llm = build_llm(folder, "tiny_one_bucket", max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for output, tokens in zip(outputs, expected[:2], strict=True):
        assert [list(s.token_ids) for s in output.outputs] == [tokens] * 3
    # what describe() says of the cache: each kind, and why prefix caching is off
    described = llm.engine.describe()
    groups = {g["kind"] + str(g.get("ratio", "")): g for g in described["cache_groups"]}
    window, csa, hca = groups["sliding_window"], groups["compressed_entries4"], groups[
        "compressed_entries8"]  # fmt: skip
    # one K=V entry of head_dim 16 floats per layer and position; CSA's entry and indexer
    # key (16 + 8 floats) per 4 tokens in its 2 layers, HCA's entry per 8 tokens in its 2
    assert window["bytes_per_token"] == 6 * 16 * 4 and window["sliding_window"] == 8
    assert csa["bytes_per_token"] == 2 * (16 + 8) * 4 / 4 and csa["layers"] == [1, 3]
    assert hca["bytes_per_token"] == 2 * 16 * 4 / 8 and hca["layers"] == [0, 4]
    assert groups["recurrent_state"]["layers"] == [0, 1, 3, 4]
    resolved = described["resolved"]
    assert resolved["prefix_caching"] == {"value": False, "reason": PREFIX_CACHING_OFF}
    assert resolved["attention"]["reason"].startswith("not used")
    assert resolved["compressed_attention"]["value"] == ("cpu" if can_build() else "reference")


@pytest.mark.parametrize(
    "option",
    [
        {"speculative_method": "draft"},  # (drafting with itself)
        {"kv_cache_dtype": "int8"},
        {"quantization": "int8"},
        {"batch_invariant": True},
        {"layer_execution": "per_layer"},
        {"weight_layout": "out_in"},
    ],
    ids=lambda option: next(iter(option)),
)
def test_options_deepseek_v4_cannot_run_with_are_refused(served, option):
    if option.get("speculative_method") == "draft":
        option = option | {"draft_model": str(served[0])}
    with pytest.raises(ValueError, match="is not supported on DeepSeek-V4"):
        build_llm(served[0], "tiny_one_bucket", **option)


def test_speculation_through_the_compressors_gives_hugging_faces_tokens(served):
    """n-gram proposals (prompts that repeat a phrase, so that proposals come; most of them
    rejected, across window ends of both kinds): the compressors' rings need no rollback, and
    the tokens are HF's greedy ones, here with preemption too."""
    folder, _ = served
    rng = np.random.default_rng(5)
    prompts = [list(np.tile(rng.integers(3, 320, size=n), 5)) for n in (3, 4, 5, 7)]
    expected = hf_greedy(folder, prompts, 24)
    llm = build_llm(
        folder,
        "tiny_one_bucket",
        num_kv_blocks=9,
        speculative_method="ngram",
        num_speculative_tokens=6,
        speculative_adaptive=False,
        prompt_lookup_min=1,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = llm.engine.stats().spec
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    spec = llm.engine.stats().spec
    accepted = spec.num_accepted_tokens - before.num_accepted_tokens
    proposed = spec.num_draft_tokens - before.num_draft_tokens
    print(f"proposed {proposed}, accepted {accepted}")
    assert proposed > 2 * accepted and proposed > 40  # many proposals, most rejected
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("tp,expert_parallel", [(2, False), (4, True)], ids=["tp2", "ep4"])
def test_split_over_devices_generates_hugging_faces_tokens(served, tp, expert_parallel):
    """The experts split within each (tp) or whole per device (ep), the shared expert's
    columns, the vocabulary and the query heads split (the K=V head, the compressors and the
    indexer whole on every device)."""
    folder, expected = served
    llm = build_llm(
        folder, "tiny_one_bucket", tensor_parallel_size=tp, expert_parallel=expert_parallel
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    gate_up = llm.engine.runner.state["layers"]["experts_gate_up"].get_value().w
    axis = 1 if expert_parallel else 4  # [L, X, E, 2, I] ("in_out")
    assert gate_up.addressable_shards[0].data.shape[axis] * tp == gate_up.shape[axis]
    layers = llm.engine.runner.state["layers"]
    q_b, sinks = layers["q_b_proj"].get_value(), layers["sinks"].get_value()  # [L, Rq, H D]
    assert q_b.addressable_shards[0].data.shape[2] * tp == q_b.shape[2]
    assert sinks.addressable_shards[0].data.shape[1] * tp == sinks.shape[1]  # [L, H]
    kv = layers["kv_proj"].get_value()
    assert kv.addressable_shards[0].data.shape == kv.shape


def test_the_pallas_kernels_swap_in_under_jit(served):
    """The Pallas attention, indexer and compressor kernels (interpreted on CPU) in place of
    the references, in the engine's step, give HF's tokens."""
    from pallas_kernels.compressor import kernel

    folder, expected = served
    llm = build_llm(folder, "tiny_one_bucket", compressed_attention_impl="pallas_interpret")
    assert llm.engine.describe()["resolved"]["compressed_attention"]["value"] == "pallas_interpret"
    assert llm.engine.runner.kernels.compressor.func is kernel.compress
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected[:2]


def test_compressed_attention_impl_is_refused_for_other_models(tmp_path):
    from tests.support.models import make_tiny_model

    with pytest.raises(ValueError, match="compressed_attention_impl applies to DeepSeek-V4"):
        build_llm(
            make_tiny_model(tmp_path), "tiny_one_bucket", compressed_attention_impl="reference"
        )


def test_a_budget_sized_cache_serves_contexts_past_the_windows_pool(served):
    """Sized by kv_cache_memory_gb, the window's pool holds the running requests' windows
    (16 blocks of 8 here) and the entries' pools the context: a 150-token prompt, which no
    window pool of that size could hold whole, gives HF's tokens."""
    folder, _ = served
    prompt = list(np.random.default_rng(9).integers(3, 320, size=150))
    llm = build_llm(
        folder, "tiny_one_bucket", num_kv_blocks=None, kv_cache_memory_gb=0.0005, max_model_len=192
    )
    assert llm.engine.kv_cache_manager.pool.num_blocks * 8 < 150
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert [list(outputs[0].outputs[0].token_ids)] == hf_greedy(folder, [prompt], 12)

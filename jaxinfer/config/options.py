"""EngineOptions: everything a user may set, declared once.

Each field carries its help text (and, where the values are a closed set, its choices) as field
metadata; the command-line flags and the TOML keys are generated from these fields
(jaxinfer.config.flags), and "auto" values are settled in one place (jaxinfer.config.resolve).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxinfer.config.validate import check_options
from jaxinfer.layers.kv_cache import KV_CACHE_DTYPES
from jaxinfer.layers.quantization import METHODS, Quantization
from pallas_kernels.int4_matmul.reference import GROUP_SIZES

DTYPES = ("float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64, 128)
LAYER_EXECUTIONS = ("auto", "scan", "per_layer")
WEIGHT_LAYOUTS = ("auto", "in_out", "out_in")
QUANTIZATIONS = METHODS
MATMUL_IMPLS = ("auto", "xla", "cpu", "pallas", "pallas_interpret")
GGUF_MODES = ("auto", "on", "off")
LOAD_FORMATS = ("auto", "dummy")
REASONING_STYLES = ("qwen3", "deepseek_r1")
SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft", "mtp")
WARMUPS = ("auto", "all", "background")
LORA_RANKS = (8, 16, 32, 64, 128, 256)


def option(default: Any, help: str, choices: tuple | None = None, **kwargs) -> Any:
    """A field of EngineOptions: its default, help text and closed set of values, if any."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices}, **kwargs)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What a user may set: LLM(**options), command-line flags, a TOML file's [engine] table.
    Validated on creation; "auto" and None are settled by jaxinfer.config.resolve."""

    model: str | None = option(
        None,
        "None for the default model (SmolLM2-135M-Instruct), a Hugging Face folder or "
        "a .gguf file.",
    )
    load_format: str = option(
        "auto",
        "auto (the checkpoint) or dummy (random weights drawn on the device, none read).",
        LOAD_FORMATS,
    )
    dtype: str = option(
        "auto",
        "Activations, weights and KV cache: auto (float32 on CPU, bfloat16 on GPU).",
        ("auto", *DTYPES),
    )
    max_model_len: int | None = option(
        None, "Longest sequence (prompt + output); unset: the model's maximum."
    )
    max_num_seqs: int = option(64, "Most requests in one step.")
    max_num_batched_tokens: int = option(
        512, "Token budget of one step; longer prompts are chunked."
    )
    token_buckets: tuple[int, ...] | None = option(
        None,
        "The step sizes (tokens) compiled, each once (flag: 1,8,64; TOML: [1, 8, 64]): a step "
        "is padded to the smallest that holds it; max_num_batched_tokens is always one. Fewer "
        "buckets compile sooner and pad more. Unset: 1, 2, 4, then powers of two and the "
        "midpoints between them (a step pads by at most a third).",
    )
    block_size: int = option(16, "Tokens per KV-cache block.", BLOCK_SIZES)
    num_kv_blocks: int | None = option(
        None,
        "KV-cache blocks in the pool (block 0 is the null block); unset: sized from "
        "kv_cache_memory_gb.",
    )
    kv_cache_memory_gb: float = option(
        1.0, "Memory budget of the KV cache (GiB) when num_kv_blocks is unset."
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV-cache format: auto (the model dtype); int8 (a scale per token and KV head); "
        "fp8_e4m3 or fp8_e5m2 (a scale per KV head, from the checkpoint's k_scale / v_scale "
        "or calibrated at start-up). A smaller format holds more tokens in the same memory.",
        KV_CACHE_DTYPES,
    )
    cache_dir: str = option(
        str(Path.home() / ".cache" / "jaxinfer"),
        "Where converted models, built C++ kernels and compiled programs are kept.",
    )
    enable_prefix_caching: bool = option(
        True, "Reuse the KV blocks of prompt prefixes computed before."
    )
    layer_execution: str = option(
        "auto",
        "scan (one program per step, the layers under lax.scan), per_layer (one "
        "compiled layer program called per layer) or auto: scan, except on CPU without the "
        "matmul kernel, where the scan's per-layer weight slices are copies.",
        LAYER_EXECUTIONS,
    )
    async_scheduling: bool | None = option(
        None,
        "Schedule and enqueue step N+1 while the device runs step N; unset: on for "
        "accelerators, off on CPU, where the device is the host's own cores.",
    )
    warmup: str = option(
        "all",
        "What is compiled before the engine serves: all (every token bucket) or background "
        "(the smallest and largest bucket; the others on a background thread while it serves, "
        "a step padded to the smallest bucket compiled so far, so nothing compiles on a "
        "request's path); auto: background where it can run (one process, layers under a "
        "scan, no draft model), otherwise all. The server's default is auto.",
        WARMUPS,
    )
    compilation_cache: bool = option(
        True, "Keep compiled programs in JAX's persistent cache for the next start."
    )
    compilation_cache_dir: str | None = option(
        None, "Where compiled programs are kept; unset: <cache_dir>/xla."
    )
    tensor_parallel_size: int = option(
        1, "Devices the model is split over (under jax.distributed, every process's count)."
    )
    attention_impl: str = option(
        "auto",
        "Attention kernel by its name in the KernelRegistry: reference (pure JAX), "
        "pallas (GPU), pallas_interpret (tests), cpu (C++), a registered name, or auto.",
    )
    ffn_impl: str = option("auto", "FFN kernel: reference, pallas, pallas_interpret, ... or auto.")
    norm_impl: str = option(
        "auto", "Residual-add + RMSNorm kernel: reference, pallas, pallas_interpret, ... or auto."
    )
    grouped_matmul_impl: str = option(
        "auto",
        "A MoE model's expert products: reference (jax.lax.ragged_dot), pallas (GPU), "
        "pallas_interpret, a registered name, or auto (the C++ kernel with the CPU matmul "
        "kernel, pallas on one GPU).",
    )
    expert_parallel: bool = option(
        False,
        "A MoE model's experts split whole over the tensor_parallel_size devices (expert "
        "parallelism) instead of each expert's intermediate axis (tensor parallelism).",
    )
    weight_layout: str = option(
        "auto",
        "Projection weights: in_out (x @ W), out_in (W @ x^T, faster on XLA:CPU at "
        "decode sizes) or auto (out_in on CPU with the reference FFN).",
        WEIGHT_LAYOUTS,
    )
    quantization: str | None = option(
        None,
        "Weight-only quantization at load: int8 (per output channel) or int4 (groups along the "
        "input axis); unset: weights in dtype, or as a quantized checkpoint (AWQ, GPTQ) holds them.",
        QUANTIZATIONS,
    )
    quantization_group_size: int = option(
        32, "int4: inputs per group (one scale and bias each).", GROUP_SIZES
    )
    quantization_symmetric: bool = option(
        False,
        "int4: symmetric groups (scale max|w| / 7, offset -8 scale); false: each group's own "
        "range (offset its minimum, as llama.cpp's Q4_1).",
    )
    int8_activations: bool = option(
        False,
        "int4 and GGUF block weights on CPU: round the activations to int8 per block (32 or "
        "256 values; int4: steps of up to 4 tokens) and multiply in integers (llama.cpp's "
        "approach; the k-quants through AVX-512 VNNI where the CPU has it): faster, numerics "
        "differ by that rounding.",
    )
    int4_matmul_impl: str = option(
        "auto",
        "int4 weights' products off the CPU matmul kernel: reference (dequantize, then XLA's "
        "dot), pallas (GPU), pallas_interpret, a registered name, or auto (pallas on one GPU).",
    )
    matmul_impl: str = option(
        "auto",
        "The out_in projections and LM head: cpu (C++ kernel), xla, pallas (tiles fixed for any "
        "rows: batch_invariant on a GPU), pallas_interpret, or auto (cpu where it runs).",
        MATMUL_IMPLS,
    )
    gguf_weights: str = option(
        "auto",
        "A model from a GGUF file: keep its projections, embedding and LM head in the file's "
        "own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), multiplied by the C++ "
        "block kernel: auto, on (an error where impossible), off (dequantized to float).",
        GGUF_MODES,
    )
    batch_invariant: bool = option(
        False,
        "Each request's outputs bit-identical whatever else shares its steps (other requests, "
        "batch size, prefill chunking): every kernel reduces in an order fixed per token. "
        "CPU: the C++ matmul and attention kernels; slower than the default.",
    )
    speculative_method: str = option(
        "none",
        "Speculative decoding: none; ngram (prompt lookup: the tokens that followed the "
        "latest earlier occurrence of the sequence's last n-gram are proposed and verified "
        "in one step); suffix (suffix decoding: the most frequent continuation of the "
        "longest suffix found in a tree of the request's tokens or of recent outputs); or "
        "draft (a smaller model with the same tokenizer, draft_model, proposes them token "
        "by token); or mtp (a DeepSeek-V4 checkpoint's multi-token-prediction layer proposes "
        "them from the model's own residual streams).",
        SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(
        5,
        "Most tokens proposed per request and step (a request may ask for fewer, and each "
        "request's count shrinks while its proposals are rejected).",
    )
    draft_model: str | None = option(
        None,
        "draft: the proposing model, a Hugging Face folder or a .gguf file with the model's "
        "vocabulary. Its KV cache has the model's number of blocks: kv_cache_memory_gb pays "
        "for both caches.",
    )
    draft_int8_activations: bool | None = option(
        None,
        "draft: int8_activations for the draft model alone (its proposals need not be "
        "exact: the verification is). Unset: on where the draft's weights are GGUF blocks "
        "or int4 on CPU, else the model's setting.",
    )
    draft_prompt_lookup: bool = option(
        True,
        "draft: a request whose last prompt_lookup_max tokens occurred in its prompt tries "
        "prompt lookup's proposals for a step in place of the draft's; if 4 or more are "
        "accepted it copies (proposes by lookup alone, the draft leaving it), else it tries "
        "again later.",
    )
    prompt_lookup_min: int = option(
        3, "ngram: the shortest suffix looked up (2 matches code too loosely to pay)."
    )
    prompt_lookup_max: int = option(5, "ngram: the longest suffix looked up.")
    suffix_max_depth: int = option(
        32,
        "suffix: the longest match plus proposal (matches use up to half of it, the rest "
        "is for the proposal).",
    )
    suffix_cache_max_tokens: int = option(
        16384,
        "suffix: output tokens of finished requests the server's index holds (oldest "
        "evicted first); its entries are at most 4 per token.",
    )
    suffix_min_token_prob: float = option(
        0.1,
        "suffix: a proposal stops where its path's probability (the product of each token's "
        "frequency after the tokens before it) falls below this.",
    )
    suffix_max_spec_factor: float = option(
        1.0, "suffix: at most this many proposals per token of the suffix matched."
    )
    speculative_adaptive: bool | None = option(
        None,
        "Plan each step's proposals from the step times the engine measures and each "
        "request's acceptance, taking only as many as pay for their time (none when the "
        "batch is large or acceptance low); off: proposals where a step has room for free "
        "(speculative_free_tokens). Unset: on, but off with several processes (their plans "
        "would differ).",
    )
    speculative_free_tokens: int | None = option(
        None,
        "A step verifies at most this many proposals; where step times are not measured "
        "(speculative_adaptive off, or not yet), proposals may grow a step to this many tokens "
        "(past that they only fill the padding of its token bucket): steps this small cost "
        "about as much as one token's. Unset: 8 on CPU, 64 on accelerators.",
    )

    runner: str = option(
        "generate",
        "generate (every API), or pooling: an embedding-only server (generation refused).",
        ("generate", "pooling"),
    )
    pooling_type: str = option(
        "auto",
        "Embeddings pool the prompt's final-norm states: last (token), mean, cls (first), or "
        "auto (a sentence-transformers folder's pooling, else last).",
        ("auto", "last", "mean", "cls"),
    )
    enable_lora: bool = option(
        False,
        "Serve LoRA adapters (PEFT folders) per request, rows of many adapters in one step.",
    )
    max_loras: int = option(
        1, "enable_lora: adapters resident at once (device slots; least recently used leave)."
    )
    max_lora_rank: int = option(16, "enable_lora: the largest adapter rank taken.", LORA_RANKS)
    lora_impl: str = option(
        "auto", "enable_lora: the batched LoRA kernel (reference, cpu, pallas, ...) or auto."
    )
    gated_delta_impl: str = option(
        "auto",
        "A hybrid model's delta-rule kernel (reference, cpu, pallas, ...) or auto; other "
        "models: auto only.",
    )
    compressed_attention_impl: str = option(
        "auto",
        "DeepSeek-V4's attention, Lightning Indexer and compressor kernels (reference, "
        "cpu, pallas, pallas_interpret) or auto; other models: auto only.",
    )
    reasoning_parser: str | None = option(
        None,
        "The model's <think> blocks: qwen3 (where the output or the prompt opens one) or "
        "deepseek_r1 (outputs start in one), split off as reasoning_content; grammars apply "
        "after the block. Unset: no reasoning is parsed.",
        REASONING_STYLES,
    )
    random_seed: int | None = option(
        None,
        "Root of unseeded requests' seeds (from it and the request's id: an LLM API run "
        "repeats; the server's ids are random; run_batch derives each line's from its "
        "custom_id). Unset: drawn at start-up (process 0's, shared under jax.distributed).",
    )
    check_schedule: bool = option(
        False,
        "Debug, several processes: before each step, compare a digest of its schedule across "
        "processes and stop with an error at the first difference (a collective per step).",
    )

    def __post_init__(self):
        check_options(self)


def refuse_options(options: EngineOptions, refused: dict[str, bool], model: str) -> None:
    """A ValueError naming the first option set in `refused` (name -> whether it is set) that
    `model` (its kind, in words) cannot run with yet."""
    for name, is_set in refused.items():
        if is_set:
            raise ValueError(f"{name} {getattr(options, name)!r} is not supported on {model} yet")


def quantization_of(options: EngineOptions) -> Quantization | None:
    """The quantization at load the options ask for (None: weights as the checkpoint has them)."""
    if options.quantization is None:
        return None
    return Quantization(
        options.quantization, options.quantization_group_size, options.quantization_symmetric
    )

"""The MoE FFN against a dense FFN with the same active parameters, same process.

    python -m tools.bench_moe --tokens=1,32,512
    python -m tools.bench_moe --engine     # also a tiny MoE model in the engine vs dense

Layer: a random MoE layer (--experts experts of width --expert_intermediate, top --top_k,
hidden --hidden) and a dense gated FFN of width top_k * expert_intermediate: each token
multiplies the same number of weights in both. Both run as the engine runs them on this
machine (jaxinfer.config.resolve's CPU defaults: "out_in" weights, the C++ matmul kernel and
its grouped product), routed by a random router; the MoE layer includes its router, the sort
and the combine. For each token count: the median time of each (alternating rounds) and the
ratio (goal: at most 1.5x at 32 and 512 tokens). --reference adds the MoE layer through the
pure-JAX reference (jax.lax.ragged_dot, dense over all experts on XLA:CPU) up to
--reference_max_tokens tokens.

--engine: random Qwen3-MoE (64 experts of width 128, top 8) and Qwen3 (dense, width 1024)
models of equal active size (4 layers, hidden 512), written by transformers into a temporary
folder, each run by the engine (CPU defaults) on the same 64-token prompts, 1 and
--engine_batch at a time: the decode step time, from the difference between generating
--engine_tokens and twice as many tokens (the same prefill in both; medians of --rounds), and
the time to the first token (the prompts' prefill and one sample).
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cpu_kernels.matmul.kernel import load_matmul
from jaxinfer.arch_config import LlamaConfig, MoeConfig, RouterConfig
from jaxinfer.config import EngineOptions
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import IN_OUT, OUT_IN, dense_ffn
from jaxinfer.layers.moe.experts import moe_ffn
from jaxinfer.layers.native_kernels import KernelMatmul
from jaxinfer.models.params import as_weights, quantize_weights, random_params, to_layout
from tools.device_rates import timed

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["1", "32", "512"], "Tokens in a step.")
flags.DEFINE_integer("hidden", 1024, "Hidden size.")
flags.DEFINE_integer("experts", 64, "Routed experts.")
flags.DEFINE_integer("top_k", 8, "Experts per token.")
flags.DEFINE_integer("expert_intermediate", 256, "Each expert's intermediate size.")
flags.DEFINE_enum("quantization", None, ["int8"], "Weight-only quantization of both layers.")
flags.DEFINE_integer("repeats", 10, "Timed samples per case and round (the median is kept).")
flags.DEFINE_integer("rounds", 3, "Alternating rounds of MoE and dense (medians reported).")
flags.DEFINE_bool("reference", False, "Also time the MoE layer through the pure-JAX reference.")
flags.DEFINE_integer("reference_max_tokens", 32, "Largest token count the reference runs.")
flags.DEFINE_bool("engine", False, "Also run tiny MoE and dense models in the engine.")
flags.DEFINE_integer("engine_batch", 16, "Requests decoded together in the engine run.")
flags.DEFINE_integer("engine_tokens", 32, "Tokens each engine request generates.")
flags.DEFINE_string("output_json", None, "Write the results here too.")


def layer_config(hidden: int, experts: int, top_k: int, intermediate: int) -> LlamaConfig:
    return LlamaConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=0,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=hidden // 8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
        moe=MoeConfig(RouterConfig(experts, top_k, renormalize=True), intermediate),
    )


def _layer(config: LlamaConfig, layout: str, dense_width: int = 0) -> dict:
    """Layer 0 of a random model in `layout` (a dense FFN of dense_width when > 0)."""
    if dense_width:
        config = LlamaConfig(**{**vars(config), "moe": None, "intermediate_size": dense_width})
    weights = as_weights(config, random_params(config, np.float32, seed=1))
    if FLAGS.quantization:
        weights = quantize_weights(config, weights, FLAGS.quantization)
    layers = to_layout(weights, layout)["layers"]
    return jax.tree.map(lambda a: jax.numpy.asarray(a[0]), layers)


def layer_rows(kernels: ModelKernels) -> list[dict]:
    cfg = layer_config(FLAGS.hidden, FLAGS.experts, FLAGS.top_k, FLAGS.expert_intermediate)
    moe = _layer(cfg, kernels.weight_layout)
    dense = _layer(cfg, kernels.weight_layout, FLAGS.top_k * FLAGS.expert_intermediate)
    reference = ModelKernels(weight_layout=IN_OUT)
    moe_in_out = _layer(cfg, IN_OUT) if FLAGS.reference else None
    # the weights are arguments, as in the engine (closed over, XLA would fold them)
    run_moe = functools.partial(jax.jit(lambda x, p: moe_ffn(cfg, p, x, kernels)), p=moe)
    run_dense = functools.partial(
        jax.jit(lambda x, p: dense_ffn(x, p["gate_up_proj"], p["down_proj"], kernels)), p=dense
    )
    run_reference = functools.partial(
        jax.jit(lambda x, p: moe_ffn(cfg, p, x, reference)), p=moe_in_out
    )
    rows = []
    rng = np.random.default_rng(0)
    for tokens in map(int, FLAGS.tokens):
        x = jax.numpy.asarray(rng.standard_normal((tokens, FLAGS.hidden)), np.float32)
        moe_ms, dense_ms = [], []
        for _ in range(FLAGS.rounds):
            moe_ms.append(timed(run_moe, x, repeats=FLAGS.repeats) * 1e3)
            dense_ms.append(timed(run_dense, x, repeats=FLAGS.repeats) * 1e3)
        row = {
            "tokens": tokens,
            "moe_ms": float(np.median(moe_ms)),
            "dense_ms": float(np.median(dense_ms)),
        }
        row["moe_over_dense"] = row["moe_ms"] / row["dense_ms"]
        if FLAGS.reference and tokens <= FLAGS.reference_max_tokens:
            row["reference_moe_ms"] = timed(run_reference, x, repeats=3) * 1e3
        rows.append(row)
        print(
            f"| {tokens} | {row['moe_ms']:.3f} ms | {row['dense_ms']:.3f} ms | "
            f"{row['moe_over_dense']:.2f}x |"
            + (f" {row['reference_moe_ms']:.1f} ms |" if "reference_moe_ms" in row else ""),
            flush=True,
        )
    return rows


def _write_models(folder: Path) -> dict[str, Path]:
    """Random Qwen3-MoE and Qwen3 models of equal active size (transformers, no download)."""
    import torch
    import transformers

    from tools.tiny_tokenizer import write_tiny_tokenizer

    common = dict(
        vocab_size=512,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    width = 128
    models = {
        "moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common,
                num_experts=64,
                num_experts_per_tok=8,
                moe_intermediate_size=width,
                norm_topk_prob=True,
            )
        ),
        "dense": transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, intermediate_size=8 * width)
        ),
    }
    out = {}
    for name, model in models.items():
        torch.manual_seed(0)
        model.eval().save_pretrained(folder / name)
        write_tiny_tokenizer(folder / name, common["vocab_size"])
        out[name] = folder / name
    return out


def engine_rows() -> list[dict]:
    from jaxinfer import LLM, SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = _write_models(Path(tmp))
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(3, 500, 64))) for _ in range(FLAGS.engine_batch)]
        for name, folder in folders.items():
            llm = LLM(model=str(folder), max_model_len=256, max_num_seqs=FLAGS.engine_batch)
            row = {"model": name}
            for batch in (1, FLAGS.engine_batch):

                def run(tokens: int, batch: int = batch, llm=llm) -> float:
                    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
                    start = time.perf_counter()
                    llm.generate(prompts[:batch], params)
                    return time.perf_counter() - start

                run(2)  # warm
                short, long = FLAGS.engine_tokens, 2 * FLAGS.engine_tokens
                times = [(run(short), run(long)) for _ in range(FLAGS.rounds)]
                # the same prefill in both: the difference is `short` decode steps
                step = float(np.median([(b - a) / short for a, b in times]))
                row[f"decode_step_ms_batch{batch}"] = step * 1e3
                # the prompts' prefill and one sampled token
                first = [run(1) for _ in range(FLAGS.rounds)]
                row[f"first_token_ms_batch{batch}"] = float(np.median(first) * 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    moe, dense = rows
    for key in [k for k in moe if k != "model"]:
        print(f"{key}: MoE / dense {moe[key] / dense[key]:.2f}x")
    return rows


def main(argv):
    del argv
    matmul = load_matmul(Path(EngineOptions().cache_dir) / "cpu_kernels")
    kernels = ModelKernels(weight_layout=OUT_IN, matmul=KernelMatmul(matmul))
    print(
        f"MoE: {FLAGS.experts} experts x {FLAGS.expert_intermediate}, top {FLAGS.top_k}, hidden "
        f"{FLAGS.hidden}; dense: width {FLAGS.top_k * FLAGS.expert_intermediate}"
        + (f", {FLAGS.quantization}" if FLAGS.quantization else "")
    )
    print(
        "| tokens | MoE | dense | MoE / dense |" + (" reference MoE |" if FLAGS.reference else "")
    )
    print("| --- | --- | --- | --- |" + (" --- |" if FLAGS.reference else ""))
    result = {"layer": layer_rows(kernels)}
    if FLAGS.engine:
        result["engine"] = engine_rows()
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)

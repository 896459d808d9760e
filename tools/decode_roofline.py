"""End-to-end decode-step time of a random-weight model against its memory roofline.

    python tools/decode_roofline.py --shape=llama3_8b --batch_sizes=1,32,128 --context=1024

Builds the model of a named shape (jaxinfer.models.shapes) with random weights on the device,
a KV cache holding --context tokens for every request, and times the jitted step (all layers
under scan, the LM head on one row per request) on a decode batch: one new token per request.
The roofline is the bytes a decode step must read (every weight once, plus each request's K/V)
over the measured device-to-device copy bandwidth; the report gives the step time, that bound
and their ratio. No checkpoint or tokenizer is needed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_rates import memory_bandwidth

from jaxinfer.engine.batch import BatchInputs
from jaxinfer.layers.kernel_registry import default_registry
from jaxinfer.models.llama import LlamaForCausalLM, build_llama
from jaxinfer.models.shapes import shape

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "llama3_8b", "Model shape (jaxinfer.models.shapes).")
flags.DEFINE_list("batch_sizes", ["1", "32", "128"], "Decode batch sizes.")
flags.DEFINE_integer("context", 1024, "Tokens in each request's context (the new one included).")
flags.DEFINE_integer("block_size", 16, "KV-cache block size.")
flags.DEFINE_string("dtype", "auto", "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16.")
flags.DEFINE_string("attention_impl", "auto", "Attention kernel name.")
flags.DEFINE_string("ffn_impl", "auto", "FFN kernel name.")
flags.DEFINE_string("norm_impl", "auto", "Add + RMSNorm kernel name.")
flags.DEFINE_integer("steps", 10, "Timed steps per batch size (after two warm-up steps).")
flags.DEFINE_string("output_json", None, "Also write the rows here.")


def decode_batch(batch: int, context: int, block_size: int, vocab: int) -> BatchInputs:
    blocks_per = -(-context // block_size)
    tables = 1 + np.arange(batch * blocks_per, dtype=np.int32).reshape(batch, blocks_per)
    last = context - 1
    rng = np.random.default_rng(0)
    return BatchInputs(
        token_ids=rng.integers(0, vocab, batch).astype(np.int32),
        positions=np.full(batch, last, np.int32),
        slot_mapping=(tables[:, last // block_size] * block_size + last % block_size),
        block_tables=tables,
        seq_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int32),
        num_seqs=np.array([batch], np.int32),
    )


def weight_bytes(state: nnx.State, tied: bool) -> int:
    """Bytes a decode step reads of the parameters: everything but the embedding table (only
    B rows of it are read), unless it is also the LM head."""
    params = nnx.to_pure_dict(state)
    total = sum(a.nbytes for a in jax.tree.leaves(params["layers"]))
    total += params["norm"].nbytes
    total += params["embed"].nbytes if tied else params["lm_head"].nbytes
    return total


def main(argv):
    del argv
    cfg = shape(FLAGS.shape)
    gpu = jax.default_backend() == "gpu"
    dtype = {"auto": jnp.bfloat16 if gpu else jnp.float32}.get(FLAGS.dtype) or jnp.dtype(
        FLAGS.dtype
    )
    kernels = default_registry().resolve(
        FLAGS.attention_impl, FLAGS.ffn_impl, FLAGS.norm_impl, platform=jax.default_backend()
    )
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    block_size, context = FLAGS.block_size, FLAGS.context
    bandwidth = memory_bandwidth()

    start = time.perf_counter()
    model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model))
    del model
    params.pop("rope_cache")
    graphdef, state = build_llama(cfg, params, dtype, weight_layout=kernels.weight_layout)
    del params
    weights = weight_bytes(state, cfg.tie_word_embeddings)
    num_blocks = 1 + max(batch_sizes) * -(-context // block_size)
    kv_shape = (
        cfg.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    kv_cache = jax.random.normal(jax.random.key(1), kv_shape, dtype)
    print(
        f"{FLAGS.shape} ({jnp.dtype(dtype).name}) on {jax.devices()[0].device_kind}: weights "
        f"{weights / 1e9:.2f} GB, KV cache {kv_cache.nbytes / 1e9:.2f} GB, built in "
        f"{time.perf_counter() - start:.1f} s; memory bandwidth {bandwidth / 1e9:.0f} GB/s; "
        f"kernels {FLAGS.attention_impl}/{FLAGS.ffn_impl}/{FLAGS.norm_impl}"
    )

    def step(state, kv_cache, batch):
        return nnx.merge(graphdef, state)(kv_cache, batch, kernels=kernels)

    step = jax.jit(step, donate_argnames=("kv_cache",))
    rows = []
    for batch_size in batch_sizes:
        batch = jax.device_put(decode_batch(batch_size, context, block_size, cfg.vocab_size))
        for _ in range(2):
            kv_cache, logits = step(state, kv_cache, batch)
        logits.block_until_ready()
        begin = time.perf_counter()
        for _ in range(FLAGS.steps):
            kv_cache, logits = step(state, kv_cache, batch)
        logits.block_until_ready()
        seconds = (time.perf_counter() - begin) / FLAGS.steps
        kv_bytes = (
            batch_size
            * context
            * cfg.num_hidden_layers
            * 2
            * cfg.num_key_value_heads
            * cfg.head_dim
            * jnp.dtype(dtype).itemsize
        )
        roofline = (weights + kv_bytes) / bandwidth
        row = dict(
            shape=FLAGS.shape,
            batch=batch_size,
            context=context,
            step_ms=seconds * 1e3,
            roofline_ms=roofline * 1e3,
            percent_of_roofline=100 * roofline / seconds,
            tokens_per_s=batch_size / seconds,
        )
        rows.append(row)
        print(
            f"batch {batch_size:4d}: step {row['step_ms']:8.2f} ms, roofline "
            f"{row['roofline_ms']:7.2f} ms ({row['percent_of_roofline']:.0f}%), "
            f"{row['tokens_per_s']:.0f} tokens/s"
        )
    if FLAGS.output_json:
        meta = dict(
            device=jax.devices()[0].device_kind,
            jax=jax.__version__,
            memory_gb_s=bandwidth / 1e9,
            weights_gb=weights / 1e9,
            dtype=jnp.dtype(dtype).name,
            kernels=[FLAGS.attention_impl, FLAGS.ffn_impl, FLAGS.norm_impl],
        )
        Path(FLAGS.output_json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    app.run(main)

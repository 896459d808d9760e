"""The C++ matmul kernel (cpu_kernels.matmul) against XLA's "out_in" ops on the default
model's projection shapes, float32 and int8 weights, same process.

    python -m tools.bench_cpu_matmul --rows=1,8,32,128

For each weight (a layer's gate_up, down and qkv, and the LM head) and each row count: the
median time of XLA's path (jaxinfer.layers.linear without a kernel) and of the kernel, for
float32 weights and for int8 weights with per-output-channel scales.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cpu_kernels.matmul.kernel import load_matmul
from jaxinfer.config import EngineOptions
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import OUT_IN, lm_logits, xla_dense
from jaxinfer.layers.quantization import quantize_int8
from jaxinfer.layers.weights import Dense, Int8
from tools.device_rates import timed

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "8", "32", "128"], "Rows of x (tokens in a step).")
flags.DEFINE_integer("repeats", 20, "Timed calls per case (the median is reported).")

WEIGHTS = {  # name: (out, in) of the default model (SmolLM2-135M)
    "gate_up": ((2, 1536), 576),
    "down": ((576,), 1536),
    "qkv": ((3, 5, 64), 576),
    "lm_head": ((49152,), 576),
}


def main(argv):
    del argv
    kernel = load_matmul(Path(EngineOptions().cache_dir) / "cpu_kernels")
    rng = np.random.default_rng(0)
    print("| weight | rows | float32 XLA | float32 kernel | int8 XLA | int8 kernel |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (out, k) in WEIGHTS.items():
        w = jnp.asarray(rng.standard_normal((*out, k)) * k**-0.5, jnp.float32)
        q, scale = (jnp.asarray(a) for a in quantize_int8(np.asarray(w), axis=-1))
        if name == "lm_head":

            def xla(x, w, s=None):
                weight = Dense(w, -1) if s is None else Int8(w, s, -1)
                return lm_logits(x, weight, True, ModelKernels(weight_layout=OUT_IN))
        else:

            def xla(x, w, s=None):
                return xla_dense(x, w, OUT_IN, s)

        for rows in map(int, FLAGS.rows):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            cases = [
                (jax.jit(xla), (x, w)),
                (jax.jit(kernel), (x, w)),
                (jax.jit(xla), (x, q, scale)),
                (jax.jit(kernel), (x, q, scale)),
            ]
            times = [timed(fn, *args, repeats=FLAGS.repeats) * 1e3 for fn, args in cases]
            print(f"| {name} | {rows} | " + " | ".join(f"{t:.3f} ms" for t in times) + " |")


if __name__ == "__main__":
    app.run(main)

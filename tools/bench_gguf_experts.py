"""A MoE layer's experts kept in GGUF blocks (cpu_kernels.gguf_matmul's grouped product) against
the same experts in float32 through the C++ grouped float kernel (cpu_kernels.matmul), same
process, on the expert shapes of OLMoE-1B-7B and Qwen3-30B-A3B (their Q4_K_M files keep the
gate and up projections in Q4_K and the down projection in Q6_K or Q8_0).

    python -m tools.bench_gguf_experts --tokens=1,8,40

For each shape and step size (tokens routed to k experts each, at random): the median time of
the gate_up and the down products, per mode, and the bytes of the experts the step touches
read per second (one token: bound by reading them), beside the machine's memory read
bandwidth (tools.device_rates). Ratio: float32's time over the blocks' (exact mode).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cpu_kernels.gguf_matmul.kernel import gguf_grouped_matmul, load_gguf_matmul
from cpu_kernels.gguf_matmul.reference import dequantize_layer, pack_layers, random_rows
from cpu_kernels.matmul.kernel import grouped_matmul, load_matmul
from jaxinfer.config import EngineOptions
from tools.bench_gguf_matmul import modes  # and its --repeats
from tools.device_rates import memory_bandwidth, timed

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["1", "8", "40"], "Tokens in a step (each routed to k experts).")

SHAPES = {  # name: (experts X, per token k, hidden E, expert width I, down's format)
    "OLMoE-1B-7B": (64, 8, 2048, 1024, "Q8_0"),
    "Qwen3-30B-A3B": (128, 8, 2048, 768, "Q6_K"),
}


def experts(fmt: str, count: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(data u8[X, B], table i32[X, S, 3]) of `count` random experts [n, k] in `fmt`."""
    return pack_layers([[(fmt, random_rows(fmt, n, k, rng))] for _ in range(count)])


def routed(tokens: int, k: int, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(group_sizes i32[X], x_rows i32[T k]): each token's k distinct experts at random, the
    (token, expert) rows sorted by expert."""
    chosen = np.stack([rng.choice(count, k, replace=False) for _ in range(tokens)])  # [T, k]
    order = np.argsort(chosen.reshape(-1), kind="stable")
    sizes = np.bincount(chosen.reshape(-1), minlength=count).astype(np.int32)
    return sizes, (order // k).astype(np.int32)


def main(argv):
    del argv
    build = Path(EngineOptions().cache_dir) / "cpu_kernels"
    load_gguf_matmul(build)
    load_matmul(build)
    rng = np.random.default_rng(0)
    bandwidth = memory_bandwidth()
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    names = list(modes())
    print(
        "| shape | projection | tokens | "
        + " | ".join(f"{m}: ms (GB/s)" for m in names)
        + " | float32: ms | float32 / exact |"
    )
    print("| --- | --- | --- |" + " --- |" * (len(names) + 2))
    for shape, (count, k, hidden, width, down) in SHAPES.items():
        weights = {
            "gate_up": experts("Q4_K", count, 2 * width, hidden, rng),
            "down": experts(down, count, hidden, width, rng),
        }
        for projection, (data, table) in weights.items():
            n, inputs = int(table[0, :, 1].sum()), hidden if projection == "gate_up" else width
            floats = jnp.asarray(
                np.stack([dequantize_layer(data[g], table[g], inputs) for g in range(count)])
            )  # [X, n, K]
            data, table = jnp.asarray(data), jnp.asarray(table)
            per_expert = data.nbytes / count
            for tokens in map(int, FLAGS.tokens):
                sizes, x_rows = routed(tokens, k, count, rng)
                touched = per_expert * np.count_nonzero(sizes)
                x = jnp.asarray(rng.standard_normal((tokens, inputs)), jnp.float32)
                sizes, x_rows = jnp.asarray(sizes), jnp.asarray(x_rows)
                cells, exact = [], None
                for options in modes().values():
                    run = jax.jit(
                        lambda x, d, t, s, r, o=options, n=n: gguf_grouped_matmul(
                            x, d, t, 0, s, n=n, x_rows=r, **o
                        )
                    )
                    seconds = timed(run, x, data, table, sizes, x_rows, repeats=FLAGS.repeats)
                    exact = seconds if exact is None else exact
                    cells.append(f"{seconds * 1e3:.3f} ({touched / seconds / 1e9:.1f})")
                run = jax.jit(lambda x, w, s, r: grouped_matmul(x, w, s, x_rows=r))
                seconds = timed(run, x, floats, sizes, x_rows, repeats=FLAGS.repeats)
                cells += [f"{seconds * 1e3:.3f}", f"{seconds / exact:.2f}x"]
                print(f"| {shape} | {projection} | {tokens} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)

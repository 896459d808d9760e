"""The block kernel (cpu_kernels.gguf_matmul) on Qwen2.5-Coder's Q4_K_M projection shapes, each
activation mode and instruction set this CPU runs, same process.

    python -m tools.bench_gguf_matmul --rows=1,4,8,32,40

For each weight (the 1.5B's gate_up and qkv in Q4_K, down in Q6_K as Q4_K_M keeps half the
layers' down; the 0.5B's gate_up in Q5_0 and its LM head in Q8_0) and each row count: the
median time per call and the weights' bytes read per second, beside the machine's measured
memory read bandwidth (tools.device_rates) for the one-row steps, which read each weight once
and are bound by it. Each weight also as the loader interleaves it for the
int8 mode on AVX-512 VNNI (last column; ratio: the file's layout's time over the interleaved
one's).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cpu_kernels.gguf_matmul.kernel import has_avx512_vnni, load_gguf_matmul
from cpu_kernels.gguf_matmul.reference import INTERLEAVE, pack_layers, random_rows
from jaxinfer.config import EngineOptions
from tools.device_rates import memory_bandwidth, timed

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "4", "8", "32", "40"], "Rows of x (tokens in a step).")
flags.DEFINE_integer("repeats", 20, "Timed calls per case (the median is reported).")

WEIGHTS = {  # name: (format, out, in) of Qwen2.5-Coder-1.5B and -0.5B Q4_K_M
    "gate_up": ("Q4_K", 2 * 8960, 1536),
    "down": ("Q6_K", 1536, 8960),
    "qkv": ("Q4_K", 2048, 1536),
    "0.5B gate_up": ("Q5_0", 2 * 4864, 896),
    "0.5B lm_head": ("Q8_0", 151936, 896),
}


def modes() -> dict[str, dict]:
    found = {
        "exact": {"int8_activations": False, "avx512_vnni": False},
        "int8 AVX2": {"int8_activations": True, "avx512_vnni": False},
    }
    if has_avx512_vnni():
        found["exact AVX-512"] = {"int8_activations": False, "avx512_vnni": True}
        found["int8 AVX-512 VNNI"] = {"int8_activations": True, "avx512_vnni": True}
    return found


def main(argv):
    del argv
    kernel = load_gguf_matmul(Path(EngineOptions().cache_dir) / "cpu_kernels")
    rng = np.random.default_rng(0)
    bandwidth = memory_bandwidth()
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    names = list(modes())
    vnni = has_avx512_vnni()
    extra = ["int8 VNNI interleaved: ms (GB/s), ratio"] if vnni else []
    print("| weight | rows | " + " | ".join([f"{m}: ms (GB/s)" for m in names] + extra) + " |")
    print("| --- | --- |" + " --- |" * (len(names) + len(extra)))
    for name, (fmt, n, k) in WEIGHTS.items():
        raw = random_rows(fmt, n, k, rng)
        data, table = (jnp.asarray(a) for a in pack_layers([[(fmt, raw)]]))
        tiled = None
        layout = f"{fmt}_X16"
        if vnni and layout in INTERLEAVE:
            packed = pack_layers([[(layout, INTERLEAVE[layout](raw))]])
            tiled = tuple(jnp.asarray(a) for a in packed)
        for rows in map(int, FLAGS.rows):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            cells = []
            for options in modes().values():
                run = jax.jit(lambda x, d, t, o=options, n=n: kernel(x, d, t, 0, n=n, **o))
                seconds = timed(run, x, data, table, repeats=FLAGS.repeats)
                cells.append(f"{seconds * 1e3:.3f} ({data.nbytes / seconds / 1e9:.1f})")
            if tiled is not None:
                run = jax.jit(
                    lambda x, d, t, n=n: kernel(x, d, t, 0, n=n, **modes()["int8 AVX-512 VNNI"])
                )
                seconds = timed(run, x, *tiled, repeats=FLAGS.repeats)
                file_layout = float(cells[-1].split()[0]) / 1e3
                cells.append(
                    f"{seconds * 1e3:.3f} ({tiled[0].nbytes / seconds / 1e9:.1f}), "
                    f"{file_layout / seconds:.2f}x"
                )
            elif vnni:
                cells.append("")
            print(f"| {name} | {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)

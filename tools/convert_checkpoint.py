"""Writes a model's parameters as an Orbax checkpoint the engine loads straight into sharded
arrays, and measures load time against the safetensors path.

    python -m tools.convert_checkpoint --output=~/.cache/jaxinfer/models/SmolLM2-orbax
    python -m jaxinfer.run_batch --model=~/.cache/jaxinfer/models/SmolLM2-orbax ...

The output folder holds config.json and the tokenizer files of the source and, instead of
*.safetensors, `orbax/` (jaxinfer's parameter layout, in --dtype). With --compare_load the
tool then loads the model both ways (onto --tensor_parallel_size devices) and prints the
times.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
from absl import app, flags

from jaxinfer.config import EngineOptions
from jaxinfer.config.configure import configure
from jaxinfer.model_loader.load import load_model
from jaxinfer.model_loader.model_cache import resolve_model
from jaxinfer.model_loader.orbax_checkpoint import convert
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Source: a Hugging Face folder or .gguf; default SmolLM2.")
flags.DEFINE_string("output", None, "The folder to write.", required=True)
flags.DEFINE_string("dtype", "float32", "Stored dtype: float32, bfloat16 or float16.")
flags.DEFINE_string("cache_dir", str(Path.home() / ".cache" / "jaxinfer"), "Model cache.")
flags.DEFINE_bool("compare_load", True, "Time loading from safetensors and from Orbax.")
flags.DEFINE_integer("tensor_parallel_size", 1, "Devices to load onto for --compare_load.")
flags.DEFINE_integer("repeats", 3, "Loads per format for --compare_load (the best counts).")
flags.DEFINE_integer("num_cpu_devices", 0, "On CPU: virtual devices to split into (0: one).")


def load_seconds(folder: Path, dtype: str, tp: int) -> float:
    options = EngineOptions(dtype=dtype, tensor_parallel_size=tp, gguf_weights="off")
    config, _ = configure(options, folder)
    partitioner = Partitioner(make_mesh(tp))
    start = time.perf_counter()
    _, state, _ = load_model(folder, config, partitioner)
    jax.block_until_ready(jax.tree.leaves(state))
    return time.perf_counter() - start


def main(argv):
    del argv
    if FLAGS.num_cpu_devices:
        jax.config.update("jax_num_cpu_devices", FLAGS.num_cpu_devices)
    source = resolve_model(FLAGS.model, Path(FLAGS.cache_dir))
    output = Path(FLAGS.output).expanduser()
    start = time.perf_counter()
    convert(source, output, FLAGS.dtype)
    print(f"wrote {output} in {time.perf_counter() - start:.1f} s")
    if FLAGS.compare_load:
        tp = FLAGS.tensor_parallel_size
        times = {
            name: min(load_seconds(folder, FLAGS.dtype, tp) for _ in range(FLAGS.repeats))
            for name, folder in [("safetensors", source), ("orbax", output)]
        }
        print(
            f"load onto {tp} device(s), best of {FLAGS.repeats}: safetensors "
            f"{times['safetensors']:.2f} s, orbax {times['orbax']:.2f} s "
            f"(ratio {times['safetensors'] / times['orbax']:.2f}x)"
        )


if __name__ == "__main__":
    app.run(main)

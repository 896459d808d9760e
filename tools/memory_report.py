"""The engine's resident memory on a model: the process's peak through loading and through
warm-up (its high-water mark, read as the engine logs the end of each), and its size after a
few requests, beside the weights' bytes, the KV cache's and the model file's, and the budget
the real-models issue sets (1.5x the file plus the KV cache).

    python -m tools.memory_report --model=qwen2.5-coder-1.5b --int8_activations

The engine flags are the engine's (--kv_cache_memory_gb and the rest).
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from pathlib import Path

import jax
from absl import app

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.model_loader.model_cache import resolve_model, source_gguf

define_engine_flags()
GB = 1e9


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class Marks(logging.Handler):
    """The peak when the engine logs that its model is loaded ("engine: ...") and that its
    warm-up ended ("warm-up: ...")."""

    def __init__(self):
        super().__init__()
        self.peaks: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for mark, prefix in (("load", "engine: "), ("warm-up", "warm-up: ")):
            if message.startswith(prefix) and mark not in self.peaks:
                self.peaks[mark] = peak_bytes()


def tree_bytes(*trees) -> int:
    """Bytes of the arrays of `trees`, each buffer once (the runner's top parameters are its
    state's arrays)."""
    seen = {}
    for leaf in jax.tree.leaves(trees):
        if hasattr(leaf, "nbytes"):
            key = (
                leaf.unsafe_buffer_pointer() if hasattr(leaf, "unsafe_buffer_pointer") else id(leaf)
            )
            seen[key] = leaf.nbytes
    return sum(seen.values())


def main(argv):
    del argv
    options = engine_options_from_flags()
    folder = resolve_model(options.model, Path(options.cache_dir))
    source = source_gguf(options.model, folder)
    marks = Marks()
    root = logging.getLogger("jaxinfer")
    root.addHandler(marks)
    root.setLevel(logging.INFO)
    llm = LLM(**dataclasses.asdict(options))
    runner = llm.engine.runner
    layers = getattr(runner, "state", None) or getattr(runner, "layer_params", None)
    weights = tree_bytes(layers, runner.top_params)
    kv = tree_bytes(runner.kv_cache)
    built = resident_bytes()
    prompts = [[100 + i] * 64 for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    served = resident_bytes()
    file = source.stat().st_size if source is not None else None
    print(f"model {options.model}: {llm.engine.gguf_weights or 'no weight'} kept in blocks")
    print(f"  weights resident: {weights / GB:.3f} GB; KV cache {kv / GB:.3f} GB")
    if file is not None:
        budget = 1.5 * file + kv
        print(f"  file {file / GB:.3f} GB; weights {weights / file:.3f}x the file")
        print(f"  budget (1.5x the file + the KV cache): {budget / GB:.3f} GB")
    rows = [
        ("peak through loading", marks.peaks.get("load")),
        ("peak through warm-up", marks.peaks.get("warm-up")),
        ("resident after warm-up", built),
        ("resident after 4 requests", served),
        ("peak overall", peak_bytes()),
    ]
    for name, value in rows:
        if value is None:
            continue
        ratio = f" ({value / budget:.2f}x the budget)" if file is not None else ""
        print(f"  {name}: {value / GB:.3f} GB{ratio}")


if __name__ == "__main__":
    app.run(main)

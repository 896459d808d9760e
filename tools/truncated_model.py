"""A copy of a Llama-family model keeping only its first decoder layers: a draft model for
speculative decoding that shares the model's tokenizer (the embedding, final norm and LM head
are the model's own).

    python -m tools.truncated_model --num_layers=8 --out=/tmp/smollm2-8layers
    python -m tools.bench_spec --speculative_method=draft --draft_model=/tmp/smollm2-8layers

--model: a Hugging Face folder with safetensors weights; unset: the default model (converted
into --cache_dir first if it is not there yet).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from absl import app, flags
from safetensors.numpy import load_file, save_file

from jaxinfer.model_loader.model_cache import resolve_model

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Source model folder; unset: the default model.")
flags.DEFINE_string("cache_dir", str(Path.home() / ".cache" / "jaxinfer"), "Model cache.")
flags.DEFINE_integer("num_layers", 8, "Decoder layers kept (the first ones).")
flags.DEFINE_string("out", None, "Folder written.", required=True)

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncated_copy(source: Path, target: Path, num_layers: int) -> Path:
    """Writes `target`: `source` with its first `num_layers` decoder layers."""
    config = json.loads((source / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}]")
    config["num_hidden_layers"] = num_layers
    target.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, value in load_file(path).items():
            match = LAYER.match(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = value
    if not tensors:
        raise ValueError(f"{source}: no safetensors weights")
    save_file(tensors, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def main(argv):
    del argv
    source = resolve_model(FLAGS.model, Path(FLAGS.cache_dir))
    out = truncated_copy(source, Path(FLAGS.out), FLAGS.num_layers)
    print(f"wrote {out}: the first {FLAGS.num_layers} layers of {source}")


if __name__ == "__main__":
    app.run(main)

"""A copy of a Llama-family model keeping only some of its decoder layers: a draft model for
speculative decoding that shares the model's tokenizer (the embedding, final norm and LM head
are the model's own). Layers skipped from the middle keep a draft far closer to the model
than the same number cut from the end (the final norm and LM head read the last layers'
residual stream).

    python -m tools.truncated_model --layers=0-3,24-29 --out=/tmp/smollm2-draft
    python -m tools.bench_spec --speculative_method=draft --draft_model=/tmp/smollm2-draft

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
flags.DEFINE_string("layers", "0-3,24-29", "Decoder layers kept: indices and ranges, in order.")
flags.DEFINE_string("out", None, "Folder written.", required=True)

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def parse_layers(text: str) -> list[int]:
    """ "0-3,24-29" -> [0, 1, 2, 3, 24, ..., 29]."""
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers.extend(range(int(first), int(last or first) + 1))
    return layers


def truncated_copy(source: Path, target: Path, layers: list[int]) -> Path:
    """Writes `target`: `source` with only the decoder layers `layers` (renumbered 0, 1, ...)."""
    config = json.loads((source / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not layers or sorted(set(layers)) != layers or not 0 <= layers[0] <= layers[-1] < total:
        raise ValueError(f"layers must be ascending and distinct, in [0, {total}), got {layers}")
    config["num_hidden_layers"] = len(layers)
    renumbered = {old: new for new, old in enumerate(layers)}
    target.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, value in load_file(path).items():
            match = LAYER.match(name)
            if match is None:
                tensors[name] = value
            elif int(match.group(1)) in renumbered:
                new = renumbered[int(match.group(1))]
                tensors[f"model.layers.{new}.{name[match.end() :]}"] = value
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
    layers = parse_layers(FLAGS.layers)
    out = truncated_copy(source, Path(FLAGS.out), layers)
    print(f"wrote {out}: layers {FLAGS.layers} of {source}")


if __name__ == "__main__":
    app.run(main)

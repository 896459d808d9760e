"""Parameters as an Orbax checkpoint: written once by tools/convert_checkpoint.py, restored
straight into sharded device arrays (each process reads only the shards its devices hold).

A converted folder is a Hugging Face-style folder (config.json, tokenizer files) whose weights
are `orbax/` instead of *.safetensors: the parameter tree of jaxinfer's layout (fused QKV
grouped by KV head, gate/up stacked) with the checkpoint's own KV heads (no replication).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxinfer.config import EngineOptions, model_arch
from jaxinfer.config.resolved import DTYPES
from jaxinfer.model_loader.safetensors_loader import load_llama_params, replicate_kv
from jaxinfer.parallel.sharding import Partitioner

PARAMS_DIR = "orbax"
MARKER = "jaxinfer_checkpoint.json"


def is_orbax_folder(folder: Path) -> bool:
    return (folder / MARKER).exists() and (folder / PARAMS_DIR).is_dir()


def save_params(folder: Path, params: dict[str, Any]) -> None:
    """Writes the parameter tree (host or device arrays) under folder/orbax."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((folder / PARAMS_DIR).resolve(), params)
    checkpointer.wait_until_finished()
    dtypes = sorted({str(np.dtype(a.dtype)) for a in jax.tree.leaves(params)})
    (folder / MARKER).write_text(json.dumps({"format": "orbax", "dtypes": dtypes}) + "\n")


# What a converted folder keeps of its source besides the weights.
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def convert(source: Path, output: Path, dtype: str) -> None:
    """Writes `source` (a Hugging Face folder) as a converted folder `output`."""
    arch = model_arch(EngineOptions(model=str(source)), source)
    params = load_llama_params(source, arch, np.dtype(DTYPES[dtype]))
    if output.exists():
        raise FileExistsError(f"{output} exists")
    output.mkdir(parents=True)
    for name in COPIED:
        if (source / name).exists():
            shutil.copy2(source / name, output / name)
    save_params(output, params)


def restore_params(
    folder: Path, dtype, partitioner: Partitioner, axes: dict, kv_replicas: int = 1
) -> dict[str, Any]:
    """The parameters, each array restored in `dtype` directly with its sharding from `axes`
    (the logical axes of each parameter). With kv_replicas > 1 the QKV arrays are restored
    whole on each device, then their KV heads are copied (replicate_kv) and split again."""
    path = (folder / PARAMS_DIR).resolve()
    checkpointer = ocp.StandardCheckpointer()
    stored = checkpointer.metadata(path)
    stored = getattr(stored, "item_metadata", stored)  # newer Orbax wraps the tree

    def target(meta, logical):
        shape = tuple(meta.shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=partitioner.sharding(logical, shape))

    targets = jax.tree.map(target, dict(stored), _prefix(axes, stored))
    params = checkpointer.restore(path, targets)
    if kv_replicas > 1:
        layers = dict(params["layers"])
        for name in ("qkv_proj", "qkv_bias"):
            if name in layers:
                logical = axes["layers"][name]
                replicate = jax.jit(
                    lambda x: replicate_kv(x, kv_replicas, xp=jax.numpy),
                    out_shardings=partitioner.sharding(
                        logical, _replicated_shape(layers[name].shape, kv_replicas)
                    ),
                )
                layers[name] = replicate(layers[name])
        params = {**params, "layers": layers}
    return params


def _replicated_shape(shape: tuple[int, ...], replicas: int) -> tuple[int, ...]:
    *lead, kv_heads, width, head_dim = shape
    return (*lead, kv_heads * replicas, (width - 2) // replicas + 2, head_dim)


def _prefix(axes: dict, stored: Any) -> dict:
    """The axes tree restricted to what the checkpoint holds (an untied model has lm_head)."""
    return {
        name: _prefix(axes[name], value) if isinstance(axes[name], dict) else axes[name]
        for name, value in dict(stored).items()
    }

"""The model's parameters from a folder, placed on the mesh: an Orbax checkpoint restored
straight into sharded arrays, or safetensors read on the host and then split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.layers.linear import IN_OUT
from jaxinfer.model_loader.orbax_checkpoint import is_orbax_folder, restore_params
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.llama import PARAM_AXES, build_llama
from jaxinfer.parallel.sharding import Partitioner


def load_model(
    folder: Path, config: EngineConfig, partitioner: Partitioner, weight_layout: str = IN_OUT
) -> tuple[nnx.GraphDef, nnx.State]:
    """The checkpoint is read in the loader's "in_out" layout, quantized if the config says so,
    then put in `weight_layout`."""
    arch, dtype = config.model.arch, config.model.dtype
    replicas = config.parallel.kv_replicas
    if is_orbax_folder(folder):
        params = restore_params(folder, dtype, partitioner, PARAM_AXES, replicas)
    else:
        params = load_llama_params(folder, arch, np.dtype(dtype), replicas)
    return build_llama(arch, params, dtype, partitioner, weight_layout, config.model.quantization)

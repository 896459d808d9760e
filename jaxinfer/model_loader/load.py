"""The model's parameters from a folder, placed on the mesh: an Orbax checkpoint restored
straight into sharded arrays, or safetensors read on the host and then split."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.layers.linear import OUT_IN
from jaxinfer.model_loader.gguf_blocks import INT4_TYPES, load_gguf_blocks, verified_blocks
from jaxinfer.model_loader.gguf_weights import load_gguf_params
from jaxinfer.model_loader.orbax_checkpoint import is_orbax_folder, restore_params
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.causal_lm import causal_lm
from jaxinfer.models.llama import build_llama
from jaxinfer.models.params import PARAM_AXES, as_weights, random_params, to_layout
from jaxinfer.parallel.sharding import Partitioner

logger = logging.getLogger(__name__)


def load_model(
    folder: Path,
    config: EngineConfig,
    partitioner: Partitioner,
    gguf_file: Path | None = None,
) -> tuple[nnx.GraphDef, nnx.State, list[str]]:
    """(graph, state, the weights kept in GGUF blocks). The checkpoint is read in the loader's
    "in_out" layout, quantized if the config says so, then put in the resolved weight layout.
    gguf_file: the GGUF the folder was converted from. Where the resolved options keep GGUF
    blocks, the weights are read from it in place (jaxinfer.model_loader.gguf_weights; keeping
    none is an error where they were required); under int4 in asymmetric groups of 32, the
    file's Q4_0 / Q4_1 / Q4_K projections become the int4 weights as they are (the names
    returned list either)."""
    weight_layout = config.resolved.weight_layout
    arch, dtype = config.model.arch, config.model.dtype
    replicas = config.parallel.kv_replicas
    if config.model.random_weights:  # load_format "dummy"
        params = random_params(arch, dtype, on_device=True)
        graphdef, state = build_llama(
            arch, params, dtype, partitioner, weight_layout, config.model.quantization
        )
        return graphdef, state, []
    if gguf_file is not None and config.resolved.gguf_blocks:
        params, kept = load_gguf_params(
            gguf_file, arch, np.dtype(dtype), config.resolved.gguf_interleaved
        )
        if not kept and config.resolved.gguf_blocks_required:
            raise ValueError(
                f"gguf_weights 'on': no weight of {gguf_file.name} is in a block format the "
                "kernel reads"
            )
        graphdef, state = build_llama(
            arch, params, dtype, partitioner, weight_layout, model_class=causal_lm(arch)
        )
        return graphdef, state, kept
    if is_orbax_folder(folder):
        params = restore_params(folder, dtype, partitioner, PARAM_AXES, replicas)
    else:
        params = load_llama_params(folder, arch, np.dtype(dtype), replicas)
    int4_blocks = None
    quantization = config.model.quantization
    if gguf_file is not None and quantization is not None and quantization.from_q4_blocks:
        int4_blocks = q4_blocks(gguf_file, params, config)
    graphdef, state = build_llama(
        arch, params, dtype, partitioner, weight_layout, quantization, int4_blocks, causal_lm(arch)
    )
    return graphdef, state, [] if int4_blocks is None else list(int4_blocks["layers"])


def q4_blocks(path: Path, params: dict, config: EngineConfig) -> dict | None:
    """The GGUF file's Q4_0 / Q4_1 / Q4_K projections that dequantize bit for bit to the loaded
    weights, as int4 groups of 32 to take as they are ({"layers": {name: BlockWeight}}), or
    None where there are none (jaxinfer.model_loader.gguf_blocks)."""
    reason = None
    try:
        loaded = load_gguf_blocks(path, config.model.arch)
    except (ValueError, IndexError) as error:  # not this model's file, or not a GGUF
        reason = f"{path.name} does not fit the model ({error})"
    if reason is None:
        out_in = to_layout(as_weights(config.model.arch, params), OUT_IN)
        blocks, rejected = verified_blocks(loaded, out_in)
        if rejected:
            logger.warning("GGUF blocks of %s differ from the loaded weights: not kept", rejected)
        if not blocks["layers"]:
            reason = f"no weight of {path.name} has {'/'.join(INT4_TYPES)} blocks equal to it"
    if reason is not None:
        logger.info("no GGUF int4 blocks kept: %s", reason)
        return None
    return blocks

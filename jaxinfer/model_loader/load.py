"""The model's parameters from a folder, placed on the mesh: an Orbax checkpoint restored
straight into sharded arrays, or safetensors read on the host and then split."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.layers.gguf_weights import block_tree
from jaxinfer.layers.linear import IN_OUT, OUT_IN, to_layout
from jaxinfer.model_loader.gguf_blocks import load_gguf_blocks, verified_blocks
from jaxinfer.model_loader.orbax_checkpoint import is_orbax_folder, restore_params
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.llama import PARAM_AXES, build_llama
from jaxinfer.parallel.sharding import Partitioner

logger = logging.getLogger(__name__)


def load_model(
    folder: Path,
    config: EngineConfig,
    partitioner: Partitioner,
    weight_layout: str = IN_OUT,
    gguf_weights: str = "off",
    gguf_file: Path | None = None,
) -> tuple[nnx.GraphDef, nnx.State, list[str]]:
    """(graph, state, the weights kept with GGUF blocks). The checkpoint is read in the
    loader's "in_out" layout, quantized if the config says so, then put in `weight_layout`.
    gguf_weights "auto" or "on": keep the blocks of `gguf_file` (the GGUF the folder was
    converted from) beside the weights they reproduce exactly ("out_in" only; "on": an error
    where none can be kept)."""
    arch, dtype = config.model.arch, config.model.dtype
    replicas = config.parallel.kv_replicas
    if is_orbax_folder(folder):
        params = restore_params(folder, dtype, partitioner, PARAM_AXES, replicas)
    else:
        params = load_llama_params(folder, arch, np.dtype(dtype), replicas)
    blocks = None
    if gguf_weights != "off":
        blocks = kept_gguf_blocks(gguf_file, config, params, weight_layout, gguf_weights == "on")
    graphdef, state = build_llama(
        arch,
        params,
        dtype,
        partitioner,
        weight_layout,
        config.model.quantization,
        None if blocks is None else block_tree(blocks),
    )
    names = [] if blocks is None else [*blocks["layers"], *(n for n in blocks if n != "layers")]
    return graphdef, state, names


def kept_gguf_blocks(path, config, params, weight_layout, required: bool) -> dict | None:
    """The GGUF file's blocks that dequantize bit for bit to the loaded weights ("out_in"
    arrays by weight), or None where none can be kept (a ValueError if `required`)."""
    reason = None
    if weight_layout != OUT_IN:
        reason = "they need the 'out_in' weight layout"
    elif path is None:
        reason = "the model was not converted from a GGUF file (or its folder does not keep it)"
    elif config.model.quantization is not None or config.parallel.kv_replicas != 1:
        reason = "the weights are quantized or their KV heads replicated"
    blocks, rejected = None, []
    if reason is None:
        try:
            loaded = load_gguf_blocks(path, config.model.arch)
        except (ValueError, IndexError) as error:  # not this model's file, or not a GGUF
            reason = f"{path.name} does not fit the model ({error})"
    if reason is None:
        blocks, rejected = verified_blocks(loaded, to_layout(params, OUT_IN))
        if not blocks["layers"] and len(blocks) == 1:
            reason = f"no weight of {path.name} has Q4_1 or Q8_0 blocks equal to the loaded weights"
    if reason is not None:
        if required:
            raise ValueError(f"gguf_weights 'on': no GGUF blocks can be kept: {reason}")
        logger.info("no GGUF blocks kept: %s", reason)
        return None
    if rejected:
        logger.warning("GGUF blocks of %s differ from the loaded weights: not kept", rejected)
    return blocks

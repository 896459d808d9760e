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
from jaxinfer.model_loader.orbax_checkpoint import is_orbax_folder, restore_params
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.llama import build_llama
from jaxinfer.models.params import PARAM_AXES, as_weights, to_layout
from jaxinfer.parallel.sharding import Partitioner

logger = logging.getLogger(__name__)


def load_model(
    folder: Path,
    config: EngineConfig,
    partitioner: Partitioner,
    gguf_file: Path | None = None,
) -> tuple[nnx.GraphDef, nnx.State, list[str]]:
    """(graph, state, the weights kept with GGUF blocks). The checkpoint is read in the
    loader's "in_out" layout, quantized if the config says so, then put in the resolved
    weight layout. gguf_file: the GGUF the folder was converted from, whose blocks are kept
    beside the weights they reproduce exactly, when the resolved options keep GGUF blocks
    (finding none is an error where they were required); under int4 in asymmetric groups of
    32, the file's Q4_0 / Q4_1 / Q4_K projections become the int4 weights as they are (the
    names returned list either)."""
    weight_layout = config.resolved.weight_layout
    arch, dtype = config.model.arch, config.model.dtype
    replicas = config.parallel.kv_replicas
    if is_orbax_folder(folder):
        params = restore_params(folder, dtype, partitioner, PARAM_AXES, replicas)
    else:
        params = load_llama_params(folder, arch, np.dtype(dtype), replicas)
    blocks = int4_blocks = None
    quantization = config.model.quantization
    if gguf_file is not None and config.resolved.gguf_blocks:
        required = config.resolved.gguf_blocks_required
        blocks = kept_gguf_blocks(gguf_file, config, params, required)
    elif gguf_file is not None and quantization is not None and quantization.from_q4_blocks:
        int4_blocks = q4_blocks(gguf_file, config, params)
    graphdef, state = build_llama(
        arch,
        params,
        dtype,
        partitioner,
        weight_layout,
        quantization,
        blocks,
        int4_blocks,
    )
    kept = blocks or int4_blocks
    names = [] if kept is None else [*kept["layers"], *(n for n in kept if n != "layers")]
    return graphdef, state, names


def q4_blocks(path: Path, config: EngineConfig, params: dict) -> dict | None:
    """The GGUF file's Q4_0 / Q4_1 / Q4_K projections that dequantize bit for bit to the loaded
    weights, as int4 groups of 32 to take as they are ({"layers": {name: BlockWeight}}), or
    None."""
    kept = kept_gguf_blocks(path, config, params, required=False, int4=True)
    if kept is None or not kept["layers"]:
        return None
    return {"layers": kept["layers"]}


def kept_gguf_blocks(
    path: Path, config: EngineConfig, params: dict, required: bool, int4: bool = False
):
    """The GGUF file's blocks that dequantize bit for bit to the loaded weights ("out_in"
    arrays by weight): in the gguf_matmul kernel's formats, or (int4) as int4 groups of 32;
    None where none can be kept (a ValueError if `required`). Whether blocks are wanted at all
    was settled by jaxinfer.config.resolve."""
    reason = None
    try:
        loaded = load_gguf_blocks(path, config.model.arch, int4)
    except (ValueError, IndexError) as error:  # not this model's file, or not a GGUF
        reason = f"{path.name} does not fit the model ({error})"
    if reason is None:
        out_in = to_layout(as_weights(config.model.arch, params), OUT_IN)
        blocks, rejected = verified_blocks(loaded, out_in)
        if not blocks["layers"] and len(blocks) == 1:
            kinds = "/".join(INT4_TYPES) if int4 else "Q4_1 or Q8_0"
            reason = f"no weight of {path.name} has {kinds} blocks equal to the loaded weights"
    if reason is not None:
        if required:
            raise ValueError(f"gguf_weights 'on': no GGUF blocks can be kept: {reason}")
        logger.info("no GGUF blocks kept: %s", reason)
        return None
    if rejected:
        logger.warning("GGUF blocks of %s differ from the loaded weights: not kept", rejected)
    return blocks

"""AWQ and GPTQ checkpoints' 4-bit projections, read as they are (config.json's
quantization_config, jaxinfer.arch_config.CheckpointQuantization) into int4 groups
(pallas_kernels.int4_matmul.reference), never through float.

Both store, per linear layer `prefix` with in_features K and out_features N, groups of G
inputs sharing a float16 scale s and a 4-bit zero point z: W[n, k] = (q[n, k] - z) * s. The
int4 format's bias is then -z s, kept in float32, where it is exact.

- AWQ (GEMM): `qweight` int32 [K, N / 8], `qzeros` int32 [K / G, N / 8], `scales` [K / G, N].
  Eight 4-bit values per int32 along the outputs, nibble i holding output 8c + ORDER[i] with
  ORDER = (0, 2, 4, 6, 1, 3, 5, 7).
- GPTQ: `qweight` int32 [K / 8, N] (nibble i of row r: input 8r + i), `qzeros` int32
  [K / G, N / 8] (nibble i: output 8c + i), `scales` [K / G, N], `g_idx` [K] (each input's
  group; only the plain order k // G is supported: act-order checkpoints are refused). The v1
  format ("gptq") stores each zero point minus one, "gptq_v2" the zero point itself.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.arch_config import CheckpointQuantization
from jaxinfer.layers.weights import Int4Parts
from pallas_kernels.int4_matmul.reference import pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL = tuple(range(8))


def unpack_words(words: np.ndarray, order: tuple[int, ...], axis: int) -> np.ndarray:
    """int32 [..., C, ...] -> u8 [..., 8 C, ...] along `axis`: nibble i of word c is value
    8 c + order[i]."""
    words = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [..., C, 8]
    values = np.empty_like(nibbles)
    values[..., list(order)] = nibbles
    values = values.reshape(*words.shape[:-1], -1).astype(np.uint8)
    return np.moveaxis(values, -1, axis)


def pack_words(values: np.ndarray, order: tuple[int, ...], axis: int) -> np.ndarray:
    """The inverse of unpack_words: u8 values 0 .. 15 -> int32 words along `axis`."""
    values = np.moveaxis(np.asarray(values, np.uint32), axis, -1)
    values = values.reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(values.shape[:-1], np.uint32)
    for i, position in enumerate(order):
        words |= values[..., position] << (4 * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _parts(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> Int4Parts:
    """q u8[N, K], zeros u8[N, K / G], scales f16[N, K / G] -> Int4Parts with the arrays
    "out"-first ([N, K / 2], [N, K / G]), as a checkpoint's float weights are."""
    bias = -(zeros.astype(np.float32) * scales.astype(np.float32))  # exact in float32
    return Int4Parts(pack(q), np.ascontiguousarray(scales.astype(np.float16)), bias)


def read_linear(reader, prefix: str, shape: tuple[int, int], quant: CheckpointQuantization):
    """Linear layer `prefix` ("model.layers.0.self_attn.q_proj.") of a quantized checkpoint,
    out_features x in_features = `shape`, as Int4Parts ([N, K / 2], [N, K / G] arrays)."""
    n, k = shape
    size = quant.group_size
    if k % size or n % 8:
        raise ValueError(
            f"{prefix}: {quant.method} groups of {size} need in_features ({k}) a multiple of "
            f"the group size and out_features ({n}) a multiple of 8"
        )
    scales = reader.get(prefix + "scales", (k // size, n), np.float16)
    if quant.method == "awq":
        q = unpack_words(reader.get(prefix + "qweight", (k, n // 8), np.int32), AWQ_ORDER, 1)
        zeros = unpack_words(
            reader.get(prefix + "qzeros", (k // size, n // 8), np.int32), AWQ_ORDER, 1
        )
    else:
        q = unpack_words(reader.get(prefix + "qweight", (k // 8, n), np.int32), SEQUENTIAL, 0)
        zeros = unpack_words(
            reader.get(prefix + "qzeros", (k // size, n // 8), np.int32), SEQUENTIAL, 1
        )
        if quant.zeros_minus_one:
            zeros = zeros + 1  # v1, read as AutoGPTQ does: a stored 15 is 16
        if reader.has(prefix + "g_idx"):
            g_idx = reader.get(prefix + "g_idx", (k,), np.int32)
            if not np.array_equal(g_idx, np.arange(k) // size):
                raise ValueError(
                    f"{prefix}g_idx: groups out of input order (GPTQ act-order) are not supported"
                )
    return _parts(q.T, zeros.T, scales.T)

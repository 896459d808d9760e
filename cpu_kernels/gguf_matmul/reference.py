"""Weights in llama.cpp's block formats, as a GGUF file stores them, and their product with
float32 activations, in numpy: the reference for kernel.cc.

A weight is a run of segments, each whole rows in one format (a fused projection's parts may
differ), laid out as the kernel reads them:

    data  u8[L, B]        each layer's bytes (the layers of a weight kind stacked, each padded
                          to the longest), a segment's rows one after another, each row its
                          K / values blocks as the file has them
    table i32[L, S, 3]    per layer and segment: (format, rows, byte offset in the layer);
                          rows 0 pads a layer with fewer segments

The formats are GGML's, numbered by gguf.GGMLQuantizationType. Every block is decoded by
the `gguf` package's own dequantizer here (`dequantize`): the kernel's exact mode must give
its values bit for bit.

N: output rows, K: the contracted (input) axis, M: rows of x.
"""

from __future__ import annotations

import gguf
import numpy as np

# name -> (GGML type number, values per block, bytes per block)
FORMATS = {
    name: (
        int(gguf.GGMLQuantizationType[name]),
        *gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]],
    )
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
}
_BY_NUMBER = {number: name for name, (number, _, _) in FORMATS.items()}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def format_name(number: int) -> str:
    return _BY_NUMBER[int(number)]


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K values in `fmt` (K a multiple of its block)."""
    _, values, size = FORMATS[fmt]
    if k % values:
        raise ValueError(f"{fmt} rows hold multiples of {values} values, not {k}")
    return k // values * size


def dequantize(fmt: str, raw: np.ndarray) -> np.ndarray:
    """u8[N, row bytes] -> f32[N, K], by gguf's own dequantizer."""
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]), np.float32)


def segments(table: np.ndarray) -> list[tuple[str, int, int]]:
    """One layer's table i32[S, 3] as (format name, rows, byte offset), padding dropped."""
    return [(format_name(f), int(r), int(o)) for f, r, o in np.asarray(table) if r > 0]


def layer_rows(data: np.ndarray, table: np.ndarray, k: int) -> list[tuple[str, np.ndarray]]:
    """One layer's segments as (format, u8[rows, row bytes]), from data u8[B], table [S, 3]."""
    out = []
    for fmt, rows, offset in segments(table):
        size = row_bytes(fmt, k)
        out.append((fmt, np.asarray(data[offset : offset + rows * size]).reshape(rows, size)))
    return out


def dequantize_layer(data: np.ndarray, table: np.ndarray, k: int) -> np.ndarray:
    """f32[N, K]: one layer's weight (data u8[B], table i32[S, 3])."""
    return np.concatenate([dequantize(fmt, raw) for fmt, raw in layer_rows(data, table, k)])


def round_activations(x: np.ndarray, block: int) -> np.ndarray:
    """x f32[M, K] as the int8-activation mode takes it, per `block` values (32, or 256 for
    the k-quants): q = round(x / d) (ties to even), d = max|x| / 127 in float32; returns
    q * d (float64)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inverse)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def gguf_matmul_reference(
    x: np.ndarray,  # f32[M, K]
    data: np.ndarray,  # u8[L, B]
    table: np.ndarray,  # i32[L, S, 3]
    layer: int = 0,
    int8_activations: bool = False,
) -> np.ndarray:  # f32[M, N]
    """x @ W^T for layer `layer`'s weight, in float64: exact x, or x rounded to int8 per block
    of each segment's format as the kernel's int8-activation mode rounds it."""
    k = x.shape[1]
    parts = []
    for fmt, raw in layer_rows(data[layer], table[layer], k):
        w = dequantize(fmt, raw).astype(np.float64)
        xs = x.astype(np.float64)
        if int8_activations:
            xs = round_activations(x, 256 if fmt in K_QUANTS else 32)
        parts.append(xs @ w.T)
    return np.concatenate(parts, axis=1).astype(np.float32)


def pack_layers(layers: list[list[tuple[str, np.ndarray]]]) -> tuple[np.ndarray, np.ndarray]:
    """(data u8[L, B], table i32[L, S, 3]) of each layer's segments (format, u8[rows, row
    bytes]), in output order; adjacent segments of one format are merged."""
    merged = []
    for parts in layers:
        runs: list[tuple[str, list[np.ndarray]]] = []
        for fmt, raw in parts:
            if runs and runs[-1][0] == fmt:
                runs[-1][1].append(raw)
            else:
                runs.append((fmt, [raw]))
        merged.append(
            [(fmt, np.concatenate(raws) if len(raws) > 1 else raws[0]) for fmt, raws in runs]
        )
    size = max(sum(raw.nbytes for _, raw in parts) for parts in merged)
    width = max(len(parts) for parts in merged)
    data = np.zeros((len(merged), size), np.uint8)
    table = np.zeros((len(merged), width, 3), np.int32)
    for i, parts in enumerate(merged):
        offset = 0
        for s, (fmt, raw) in enumerate(parts):
            data[i, offset : offset + raw.nbytes] = np.ascontiguousarray(raw).reshape(-1)
            table[i, s] = (FORMATS[fmt][0], raw.shape[0], offset)
            offset += raw.nbytes
    return data, table


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """u8[n, row bytes] of random blocks in `fmt`: every value bit random, the float16 scales
    finite (drawn in a sensible range, either sign where the format allows)."""
    _, values, size = FORMATS[fmt]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)

    def halves(count: int, positive: bool) -> np.ndarray:
        h = rng.uniform(0.002, 0.05, (n, k // values, count))
        if not positive:
            h = h * rng.choice([-1.0, 1.0], h.shape)
        return h.astype(np.float16).view(np.uint8)

    if fmt in ("Q4_0", "Q5_0", "Q8_0"):
        raw[..., 0:2] = halves(1, False)
    elif fmt in ("Q4_1", "Q5_1"):
        raw[..., 0:4] = halves(2, False)
    elif fmt in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = halves(2, True)
    else:  # Q6_K: d last
        raw[..., 208:210] = halves(1, False)
    return raw.reshape(n, -1)

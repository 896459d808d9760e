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

import functools

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
# Layouts the loader makes of the file's blocks (not GGML types; numbered past them): rows
# interleaved 16 at a time (INTERLEAVE), bytes per row's share of a (super)block.
INTERLEAVED = {
    "Q4_0_X16": (102, 32, 18),
    "Q4_1_X16": (103, 32, 20),
    "Q5_0_X16": (106, 32, 22),
    "Q8_0_X16": (108, 32, 34),
    "Q4_K_X16": (112, 256, 148),
    "Q6_K_X16": (114, 256, 210),
}
LAYOUTS = {**FORMATS, **INTERLEAVED}
_BY_NUMBER = {number: name for name, (number, _, _) in LAYOUTS.items()}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q4_K_X16", "Q6_K_X16")
X16 = 16  # rows of an interleaved tile
_X16_SUPER = 2368  # bytes of an interleaved tile's superblock (16 rows)


def format_name(number: int) -> str:
    return _BY_NUMBER[int(number)]


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one row of K values in `fmt` (K a multiple of its block); an interleaved
    format's rows are stored 16 at a time, a row its share."""
    _, values, size = LAYOUTS[fmt]
    if k % values:
        raise ValueError(f"{fmt} rows hold multiples of {values} values, not {k}")
    return k // values * size


def dequantize(fmt: str, raw: np.ndarray) -> np.ndarray:
    """u8[N, row bytes] -> f32[N, K], by gguf's own dequantizer (an interleaved layout's rows
    taken back to the file's blocks first)."""
    if fmt in INTERLEAVED:
        fmt, raw = fmt[:4], DEINTERLEAVE[fmt](raw)
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]), np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and minimums (u8[..., 12]) -> sc, m u8[..., 8]
    (llama.cpp's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _rows_of_tiles(parts: list[np.ndarray], n: int, width: int) -> np.ndarray:
    """Each tile's superblocks' parts ([T, S, ...] each) one after another, as u8[N, width]:
    the tile's bytes span its 16 rows' share."""
    t, s = parts[0].shape[:2]
    tiles = np.concatenate([p.reshape(t, s, -1) for p in parts], axis=-1)
    return np.ascontiguousarray(tiles).reshape(n, width)


def interleave_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows u8[N, K / 256 * 144] (N a multiple of 16) -> the kernel's interleaved layout
    u8[N, K / 256 * 148] (cpu_kernels/gguf_matmul/interleaved.h): per tile of 16 rows and
    superblock, d[16] and dmin[16] (float16), sc[8][16], m[4][16][2] (groups 2p, 2p + 1), and
    qs[8][4][16][4] (group, quarter t, row, byte b: value 8 t + b in the low nibble, 8 t + 4 + b
    in the high). The same values, scales unpacked from 6 bits to bytes."""
    n, width = raw.shape
    if n % X16 or width % 144:
        raise ValueError(f"interleave_q4_k: Q4_K rows in 16s, got {raw.shape}")
    t, s = n // X16, width // 144
    b = raw.reshape(t, X16, s, 144).transpose(0, 2, 1, 3)  # [T, S, 16, 144]
    sc, m = _k_scales(b[..., 4:16])  # [T, S, 16, 8]
    q = b[..., 16:].reshape(t, s, X16, 4, 32)
    values = np.stack([q & 0xF, q >> 4], axis=4).reshape(t, s, X16, 8, 4, 2, 4)
    packed = values[..., 0, :] | (values[..., 1, :] << 4)  # [T, S, row, g, t, b]
    parts = [
        b[..., 0:2],  # d per row
        b[..., 2:4],  # dmin per row
        sc.transpose(0, 1, 3, 2),  # [T, S, g, row]
        m.reshape(t, s, X16, 4, 2).transpose(0, 1, 3, 2, 4),  # [T, S, p, row, 2]
        packed.transpose(0, 1, 3, 4, 2, 5),  # [T, S, g, t, row, b]
    ]
    return _rows_of_tiles(parts, n, s * 148)  # [T, S, 2368] as N rows


def deinterleave_q4_k(raw: np.ndarray) -> np.ndarray:
    """interleave_q4_k's inverse: u8[N, K / 256 * 148] -> Q4_K rows u8[N, K / 256 * 144]."""
    n, width = raw.shape
    t, s = n // X16, width // 148
    tiles = raw.reshape(t, s, _X16_SUPER)
    d = tiles[..., 0:32].reshape(t, s, X16, 2)
    dmin = tiles[..., 32:64].reshape(t, s, X16, 2)
    sc = tiles[..., 64:192].reshape(t, s, 8, X16).transpose(0, 1, 3, 2)  # [T, S, row, g]
    m = tiles[..., 192:320].reshape(t, s, 4, X16, 2).transpose(0, 1, 3, 2, 4).reshape(t, s, X16, 8)
    packed = tiles[..., 320:].reshape(t, s, 8, 4, X16, 4).transpose(0, 1, 4, 2, 3, 5)
    values = np.stack([packed & 0xF, packed >> 4], axis=-2)  # [T, S, row, g, t, 2, b]
    values = values.reshape(t, s, X16, 4, 2, 32)  # [.., j, group 2j + h, i]
    qs = values[..., 0, :] | (values[..., 1, :] << 4)  # [T, S, row, 4, 32]
    scales = np.concatenate(
        [
            sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6),
            m[..., 0:4] | ((m[..., 4:8] >> 4) << 6),
            (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4),
        ],
        axis=-1,
    )
    blocks = np.concatenate([d, dmin, scales, qs.reshape(t, s, X16, 128)], axis=-1)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(n, s * 144).astype(np.uint8)


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


def gguf_grouped_matmul_reference(
    x: np.ndarray,  # f32[M, K] sorted by group; [X, K] with x_rows
    data: np.ndarray,  # u8[L G, B]
    table: np.ndarray,  # i32[L G, S, 3]
    layer: int,
    group_sizes: np.ndarray,  # i32[G]
    int8_activations: bool = False,
    x_rows: np.ndarray | None = None,  # i32[M]
    y_rows: np.ndarray | None = None,  # i32[M], a permutation
) -> np.ndarray:  # f32[M, N]
    """Each group's rows times expert g of layer `layer` (weight layer * G + g), rows after
    the last group zeros; x_rows gathers the product's rows, y_rows scatters them."""
    groups = len(group_sizes)
    xs = x if x_rows is None else x[x_rows]
    m = xs.shape[0]
    n = sum(int(rows) for _, rows, _ in table[layer * groups]) if m else 0
    out = np.zeros((m, n), np.float32)
    first = 0
    for g, size in enumerate(group_sizes):
        size = min(int(size), m - first)
        if size > 0:
            part = xs[first : first + size]
            out[first : first + size] = gguf_matmul_reference(
                part, data, table, layer * groups + g, int8_activations
            )
            first += size
    if y_rows is None:
        return out
    y = np.zeros_like(out)
    y[y_rows] = out
    return y


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
            table[i, s] = (LAYOUTS[fmt][0], raw.shape[0], offset)
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


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K superblocks u8[..., 210] -> their 256 unsigned 6-bit values u8[..., 256] (q + 32),
    in order (llama.cpp's dequantize_row_q6_K)."""
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 32)
    low = np.concatenate(
        [ql[..., 0:32] & 0xF, ql[..., 32:64] & 0xF, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], -1
    )
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
    return (low | (high << 4)).reshape(*blocks.shape[:-1], 256)


def interleave_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K rows u8[N, K / 256 * 210] (N a multiple of 16) -> the kernel's interleaved layout,
    the same size (cpu_kernels/gguf_matmul/interleaved.h): per tile of 16 rows and superblock,
    d[16] (float16), sc[8][16][2] (int8 scales of the 16-value groups 2p, 2p + 1), then per
    group j of 16 values three vectors of [16 rows][4 bytes]: A (low nibble: the low 4 bits of
    value 16 j + b; high nibble: of 16 j + 4 + b), B (the same for 16 j + 8 + b and
    16 j + 12 + b), H (bits 2 s, 2 s + 1 of byte b: the top 2 bits of value 16 j + 4 s + b)."""
    n, width = raw.shape
    if n % X16 or width % 210:
        raise ValueError(f"interleave_q6_k: Q6_K rows in 16s, got {raw.shape}")
    t, s = n // X16, width // 210
    b = raw.reshape(t, X16, s, 210).transpose(0, 2, 1, 3)  # [T, S, 16, 210]
    v = _q6_k_values(b).reshape(t, s, X16, 16, 4, 4)  # [T, S, row, j, quarter, b]
    low, high = v & 0xF, v >> 4
    a = low[..., 0, :] | (low[..., 1, :] << 4)  # [T, S, row, j, b]
    bb = low[..., 2, :] | (low[..., 3, :] << 4)
    h = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    groups = np.stack([a, bb, h], axis=-2)  # [T, S, row, j, 3, b]
    parts = [
        b[..., 208:210],  # d per row
        b[..., 192:208].reshape(t, s, X16, 8, 2).transpose(0, 1, 3, 2, 4),  # [T, S, p, row, 2]
        groups.transpose(0, 1, 3, 4, 2, 5),  # [T, S, j, vector, row, b]
    ]
    return _rows_of_tiles(parts, n, s * 210)  # [T, S, 3360] as N rows


def deinterleave_q6_k(raw: np.ndarray) -> np.ndarray:
    """interleave_q6_k's inverse: the file's Q6_K rows back."""
    n, width = raw.shape
    t, s = n // X16, width // 210
    tiles = raw.reshape(t, s, 3360)
    d = tiles[..., 0:32].reshape(t, s, X16, 2)
    sc = tiles[..., 32:288].reshape(t, s, 8, X16, 2).transpose(0, 1, 3, 2, 4).reshape(t, s, X16, 16)
    groups = tiles[..., 288:].reshape(t, s, 16, 3, X16, 4).transpose(0, 1, 4, 2, 3, 5)
    a, bb, h = groups[..., 0, :], groups[..., 1, :], groups[..., 2, :]  # [T, S, row, j, b]
    low = np.stack([a & 0xF, a >> 4, bb & 0xF, bb >> 4], axis=-2)  # [.., j, quarter, b]
    high = np.stack([(h >> (2 * q)) & 3 for q in range(4)], axis=-2)
    v = (low | (high << 4)).reshape(t, s, X16, 2, 4, 32)  # [.., n, quarter (32 values), l]
    ql = np.concatenate(
        [
            (v[..., 0, :] & 0xF) | ((v[..., 2, :] & 0xF) << 4),
            (v[..., 1, :] & 0xF) | ((v[..., 3, :] & 0xF) << 4),
        ],
        axis=-1,
    )  # [.., n, 64]
    qh = (
        (v[..., 0, :] >> 4)
        | ((v[..., 1, :] >> 4) << 2)
        | ((v[..., 2, :] >> 4) << 4)
        | ((v[..., 3, :] >> 4) << 6)
    )
    blocks = np.concatenate([ql.reshape(t, s, X16, 128), qh.reshape(t, s, X16, 64), sc, d], axis=-1)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(n, s * 210).astype(np.uint8)


def interleave_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 rows u8[N, K / 32 * 34] (N a multiple of 16) -> the kernel's interleaved layout,
    the same size (cpu_kernels/gguf_matmul/interleaved.h): per tile of 16 rows and block,
    d[16] (float16), then qs[8][16][4] (group g of 4 values, row, byte b: value 4 g + b plus
    128, unsigned)."""
    n, width = raw.shape
    if n % X16 or width % 34:
        raise ValueError(f"interleave_q8_0: Q8_0 rows in 16s, got {raw.shape}")
    t, s = n // X16, width // 34
    b = raw.reshape(t, X16, s, 34).transpose(0, 2, 1, 3)  # [T, S, 16, 34]
    u = (b[..., 2:] ^ 0x80).reshape(t, s, X16, 8, 4)  # [T, S, row, g, b]
    return _rows_of_tiles([b[..., 0:2], u.transpose(0, 1, 3, 2, 4)], n, s * 34)


def deinterleave_q8_0(raw: np.ndarray) -> np.ndarray:
    """interleave_q8_0's inverse: the file's Q8_0 rows back."""
    n, width = raw.shape
    t, s = n // X16, width // 34
    tiles = raw.reshape(t, s, 544)
    d = tiles[..., 0:32].reshape(t, s, X16, 2)
    u = tiles[..., 32:].reshape(t, s, 8, X16, 4).transpose(0, 1, 3, 2, 4).reshape(t, s, X16, 32)
    blocks = np.concatenate([d, u ^ 0x80], axis=-1)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(n, s * 34).astype(np.uint8)


# The 32-value nibble formats' interleaved headers: per row, d (and Q4_1's m) as float16,
# then Q5_0's fifth bits as masks (below); the nibbles follow.
_NIBBLE_HEADER = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2}


def _nibble_values(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 / Q5_0 blocks u8[..., bytes] -> their 32 unsigned values u8[..., 32]."""
    header = _NIBBLE_HEADER[fmt] + (4 if fmt == "Q5_0" else 0)
    qs = blocks[..., header : header + 16]
    values = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if fmt == "Q5_0":
        values = values | (np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little") << 4)
    return values


def interleave_nibbles(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Q4_0, Q4_1 or Q5_0 rows u8[N, K / 32 * bytes] (N a multiple of 16) -> the kernel's
    interleaved layout, the same size (cpu_kernels/gguf_matmul/interleaved.h): per tile of 16
    rows and block, d[16] (and Q4_1's m[16]; float16), Q5_0's h[8] (64-bit masks, bit
    4 row + b of mask s: the fifth bit of value 4 s + b), then qs[4][16][4] (quarter t, row,
    byte b: the low 4 bits of value 8 t + b in the low nibble, of 8 t + 4 + b in the high)."""
    size = FORMATS[fmt][2]
    n, width = raw.shape
    if n % X16 or width % size:
        raise ValueError(f"interleave {fmt}: rows in 16s, got {raw.shape}")
    t, s = n // X16, width // size
    b = raw.reshape(t, X16, s, size).transpose(0, 2, 1, 3)  # [T, S, 16, bytes]
    v = _nibble_values(fmt, b).reshape(t, s, X16, 4, 2, 4)  # [T, S, row, t, half, b]
    header = _NIBBLE_HEADER[fmt]
    parts = [b[..., h : h + 2] for h in range(0, header, 2)]  # d (m) per row
    if fmt == "Q5_0":
        masks = (v >> 4).transpose(0, 1, 3, 4, 2, 5).reshape(t, s, 8, 64)  # [T, S, mask, bit]
        parts.append(np.packbits(masks, axis=-1, bitorder="little"))  # [T, S, mask, 8]
    low = v & 0xF
    qs = low[..., 0, :] | (low[..., 1, :] << 4)  # [T, S, row, t, b]
    parts.append(qs.transpose(0, 1, 3, 2, 4))  # [T, S, t, row, b]
    return _rows_of_tiles(parts, n, s * size)


def deinterleave_nibbles(raw: np.ndarray, fmt: str) -> np.ndarray:
    """interleave_nibbles' inverse: the file's rows back."""
    size, header = FORMATS[fmt][2], _NIBBLE_HEADER[fmt]
    n, width = raw.shape
    t, s = n // X16, width // size
    tiles = raw.reshape(t, s, 16 * size)
    heads = [tiles[..., 32 * i : 32 * i + 32].reshape(t, s, X16, 2) for i in range(header // 2)]
    at = 16 * header
    high = np.zeros((t, s, X16, 4, 2, 4), np.uint8)
    if fmt == "Q5_0":
        bits = np.unpackbits(tiles[..., at : at + 64].reshape(t, s, 8, 8), -1, bitorder="little")
        high = bits.reshape(t, s, 4, 2, X16, 4).transpose(0, 1, 4, 2, 3, 5)  # [.., row, t, h, b]
        at += 64
    qs = tiles[..., at:].reshape(t, s, 4, X16, 4).transpose(0, 1, 3, 2, 4)  # [T, S, row, t, b]
    low = np.stack([qs & 0xF, qs >> 4], axis=-2)  # [T, S, row, t, half, b]
    v = (low | (high << 4)).reshape(t, s, X16, 32)  # value 8 t + 4 half + b
    packed = (v[..., 0:16] & 0xF) | ((v[..., 16:32] & 0xF) << 4)
    if fmt == "Q5_0":
        heads.append(np.packbits(v >> 4, axis=-1, bitorder="little"))  # qh [T, S, row, 4]
    blocks = np.concatenate([*heads, packed], axis=-1)
    return np.ascontiguousarray(blocks.transpose(0, 2, 1, 3)).reshape(n, s * size).astype(np.uint8)


INTERLEAVE = {
    "Q4_K_X16": interleave_q4_k,
    "Q6_K_X16": interleave_q6_k,
    "Q8_0_X16": interleave_q8_0,
    **{f"{f}_X16": functools.partial(interleave_nibbles, fmt=f) for f in _NIBBLE_HEADER},
}
DEINTERLEAVE = {
    "Q4_K_X16": deinterleave_q4_k,
    "Q6_K_X16": deinterleave_q6_k,
    "Q8_0_X16": deinterleave_q8_0,
    **{f"{f}_X16": functools.partial(deinterleave_nibbles, fmt=f) for f in _NIBBLE_HEADER},
}

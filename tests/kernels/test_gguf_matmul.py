"""The C++ kernel for weights in llama.cpp's block formats as a GGUF file stores them
(cpu_kernels.gguf_matmul): every format's exact mode bit for bit against the gguf package's own
dequantizer, both modes against float64 numpy (the int8-activation mode against x rounded as
that mode rounds it), for 1 to many rows, weights of several formats and stacked layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul import reference
from cpu_kernels.gguf_matmul.kernel import gguf_rows, has_avx512_vnni
from cpu_kernels.gguf_matmul.reference import (
    FORMATS,
    INTERLEAVE,
    deinterleave_q4_k,
    dequantize_layer,
    gguf_matmul_reference,
    interleave_q4_k,
    interleave_q6_k,
    pack_layers,
    random_rows,
)
from tests.support.lanes import sweep

pytestmark = pytest.mark.skipif(
    not can_build(), reason="no C++ compiler, or a CPU without AVX2/FMA"
)

# The activation modes on each instruction set: AVX2 everywhere, and the AVX-512 VNNI paths
# where this CPU has them.
VNNI = pytest.mark.skipif(not has_avx512_vnni(), reason="a CPU without AVX-512 VNNI")
MODES = {
    "exact": {"int8_activations": False, "avx512_vnni": False},
    "exact-avx512vnni": {"int8_activations": False, "avx512_vnni": True},
    "int8-avx2": {"int8_activations": True, "avx512_vnni": False},
    "int8-avx512vnni": {"int8_activations": True, "avx512_vnni": True},
}


def mode_params(kind: str = "") -> list:
    """The modes whose name holds `kind`, those on AVX-512 VNNI skipped on a CPU without."""
    return [pytest.param(m, marks=VNNI) if "vnni" in m else m for m in MODES if kind in m]


MODE_PARAMS, INT8_PARAMS, EXACT_PARAMS = mode_params(), mode_params("int8"), mode_params("exact")


def weight(fmt: str, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if fmt in INTERLEAVE:  # the loader's interleaved layouts
        return pack_layers([[(fmt, INTERLEAVE[fmt](random_rows(fmt[:4], n, k, rng)))]])
    return pack_layers([[(fmt, random_rows(fmt, n, k, rng))]])


LAYOUTS = [*FORMATS, *INTERLEAVE]  # the file's formats and the loader's interleaved ones


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("mode", EXACT_PARAMS)
def test_exact_mode_gives_the_gguf_packages_values_bit_for_bit(cpu_gguf_matmul, fmt, mode):
    """x = the identity picks every weight out of the product unrounded: the kernel's own
    dequantization, through the matmul paths (512 rows at once: the float panels; 3, 2 and 1
    at a time: the blocks streamed) and the rows path."""
    k = 512
    data, table = weight(fmt, 48, k, seed=1)
    theirs = dequantize_layer(data[0], table[0], k)  # gguf.quants
    eye = jnp.eye(k, dtype=jnp.float32)
    run = jax.jit(lambda x: cpu_gguf_matmul(x, data, table, 0, n=48, **MODES[mode]))
    assert np.array_equal(np.asarray(run(eye)).T, theirs)
    steps = [eye[j : j + 3] for j in range(0, k - 5, 3)] + [eye[-5:-3], eye[-3:-2], eye[-2:]]
    streamed = np.concatenate([np.asarray(run(x)) for x in steps])
    assert np.array_equal(streamed.T, theirs)
    rows = np.asarray(gguf_rows(jnp.arange(48), jnp.asarray(data), jnp.asarray(table), 0, k=k))
    assert np.array_equal(rows.view(np.uint32), theirs.view(np.uint32))


# The fast lane: every pair of format, mode and row count.
@pytest.mark.parametrize(
    "fmt,mode,rows", sweep(LAYOUTS, MODE_PARAMS, [1, 3, 4, 5, 7, 8, 12, 21, 277], strength=2)
)
def test_kernel_matches_numpy(cpu_gguf_matmul, fmt, mode, rows):
    """Few rows stream the weight row with every accumulator in registers (int8: 1-4 rows,
    1-8 on AVX-512 VNNI; exact: 1-3, the 4-bit formats' 1-6 on AVX-512); more take the
    many-row paths (int8: chunks of 16 rows, on AVX-512 VNNI tiles of 16 or 8 padded with zero
    rows; exact: float panels). Interleaved
    layouts on AVX-512 VNNI, int8: tiles of 16 outputs by 6 rows (and 1-5); their other
    modes rebuild the file's rows."""
    k = 768 if fmt in reference.K_QUANTS else 224
    n = 48 if fmt in INTERLEAVE else 37
    data, table = weight(fmt, n, k, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    ours = cpu_gguf_matmul(jnp.asarray(x), data, table, 0, n=n, **MODES[mode])
    theirs = gguf_matmul_reference(x, data, table, int8_activations=MODES[mode]["int8_activations"])
    assert ours.shape == (rows, n) and ours.dtype == jnp.float32
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", INT8_PARAMS)
def test_int8_activations_round_x_as_llama_cpp_does(cpu_gguf_matmul, mode):
    """The int8 mode differs from the exact one by x's rounding only: against exact x it is
    off by about that rounding (relative 1e-2), against rounded x by float error."""
    k = 512
    data, table = weight("Q4_K", 64, k, seed=5)
    x = np.random.default_rng(5).standard_normal((2, k)).astype(np.float32)
    ours = np.asarray(cpu_gguf_matmul(jnp.asarray(x), data, table, 0, n=64, **MODES[mode]))
    exact = gguf_matmul_reference(x, data, table)
    rounded = gguf_matmul_reference(x, data, table, int8_activations=True)
    scale = np.abs(exact).max()
    assert 1e-4 < np.abs(ours - exact).max() / scale < 3e-2
    assert np.abs(ours - rounded).max() / scale < 1e-5


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_segments_of_several_formats_and_stacked_layers(cpu_gguf_matmul, mode):
    """A fused weight whose parts differ in format (Q4_K_M's Q4_K and Q6_K rows; Q5_0 and Q8_0
    for rows of 896 values; interleaved tiles beside the file's rows), layers that differ,
    each read in place by its index under jit."""
    rng = np.random.default_rng(7)
    k = 512
    x16 = interleave_q4_k(random_rows("Q4_K", 16, k, rng))
    layers = [
        [("Q4_K", random_rows("Q4_K", 24, k, rng)), ("Q6_K", random_rows("Q6_K", 8, k, rng))],
        [("Q6_K", random_rows("Q6_K", 32, k, rng))],
        [("Q5_0", random_rows("Q5_0", 16, k, rng)), ("Q8_0", random_rows("Q8_0", 16, k, rng))],
        [("Q6_K_X16", interleave_q6_k(random_rows("Q6_K", 16, k, rng))), ("Q4_K_X16", x16)],
        [
            ("Q5_0_X16", INTERLEAVE["Q5_0_X16"](random_rows("Q5_0", 16, k, rng))),
            ("Q8_0", random_rows("Q8_0", 8, k, rng)),
            ("Q4_K", random_rows("Q4_K", 8, k, rng)),
        ],
        [
            (f"{f}_X16", INTERLEAVE[f"{f}_X16"](random_rows(f, 16, k, rng)))
            for f in ("Q4_1", "Q4_0")
        ],
    ]
    data, table = pack_layers(layers)
    run = jax.jit(lambda x, d, t, i: cpu_gguf_matmul(x, d, t, i, n=32, **MODES[mode]))
    for rows in (5, 12):  # the streaming paths, and the file's many-row paths beside tiles
        x = rng.standard_normal((rows, k)).astype(np.float32)
        for layer in range(len(layers)):
            ours = np.asarray(run(jnp.asarray(x), data, table, jnp.int32(layer)))
            int8 = MODES[mode]["int8_activations"]
            theirs = gguf_matmul_reference(x, data, table, layer, int8)
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q4_K_X16", "Q8_0_X16"])
@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_rows_past_valid_are_padding(cpu_gguf_matmul, fmt, mode):
    """A step's padding rows (after `valid`, traced) come out zeros; the real rows are the
    product of those rows alone (whatever x the padding holds)."""
    k = 512
    data, table = weight(fmt, 32, k, seed=9)
    x = np.random.default_rng(9).standard_normal((12, k)).astype(np.float32)
    run = jax.jit(lambda x, v: cpu_gguf_matmul(x, data, table, 0, n=32, valid=v, **MODES[mode]))
    for valid in (0, 5, 12, 40):
        ours = np.asarray(run(jnp.asarray(x), jnp.int32(valid)))
        real = min(valid, 12)
        assert not ours[real:].any()
        if real:
            theirs = gguf_matmul_reference(
                x[:real], data, table, 0, MODES[mode]["int8_activations"]
            )
            np.testing.assert_allclose(
                ours[:real], theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max()
            )


def test_bad_tables_are_clear_errors(cpu_gguf_matmul):
    data, table = weight("Q4_0", 8, 64)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(Exception, match="segments' rows do not sum to N"):
        cpu_gguf_matmul(x, data, table, 0, n=9).block_until_ready()
    bad = table.copy()
    bad[0, 0, 0] = 1  # F16: not a block format
    with pytest.raises(Exception, match="not a supported block format"):
        cpu_gguf_matmul(x, data, bad, 0, n=8).block_until_ready()
    x16, x16_table = weight("Q4_K_X16", 16, 256)
    x16_table[0, 0, 1] = 8  # an interleaved segment of half a tile
    with pytest.raises(Exception, match="not a multiple of 16"):
        cpu_gguf_matmul(jnp.ones((1, 256)), x16, x16_table, 0, n=8).block_until_ready()
    bad = table.copy()
    bad[0, 0, 2] = 16  # past the layer's bytes
    with pytest.raises(Exception, match="outside the layer's bytes"):
        cpu_gguf_matmul(x, data, bad, 0, n=8).block_until_ready()
    with pytest.raises(ValueError, match="data u8"):
        cpu_gguf_matmul(x, data.astype(np.int8), table, 0, n=8)


@pytest.mark.skipif(has_avx512_vnni(), reason="this CPU has AVX-512 VNNI")
def test_avx512_vnni_on_a_cpu_without_it_is_a_clear_error(cpu_gguf_matmul):
    data, table = weight("Q4_K", 8, 256)
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(Exception, match="without AVX-512"):
        cpu_gguf_matmul(x, data, table, 0, n=8, int8_activations=True, avx512_vnni=True)


def test_random_rows_cover_each_format():
    """The test blocks: the float16 scales finite, the values every bit pattern."""
    rng = np.random.default_rng(0)
    for fmt in FORMATS:
        raw = random_rows(fmt, 4, 256, rng)
        assert raw.shape == (4, reference.row_bytes(fmt, 256))
        assert np.isfinite(reference.dequantize(fmt, raw)).all()


def test_interleaved_q4_k_holds_the_files_values_where_its_layout_says():
    """The interleaved layout read by its own description (interleaved.h), independently of
    deinterleave_q4_k: every weight d sc q - dmin m equals gguf's dequantization of the
    file's rows; and deinterleaving gives the file's bytes back."""
    rng = np.random.default_rng(3)
    raw = random_rows("Q4_K", 32, 512, rng)
    tiles = interleave_q4_k(raw).reshape(2, 2, 2368)  # [tile, superblock, bytes]
    assert np.array_equal(deinterleave_q4_k(interleave_q4_k(raw)), raw)
    d = tiles[..., 0:32].copy().view(np.float16).astype(np.float32)  # [T, S, row]
    dmin = tiles[..., 32:64].copy().view(np.float16).astype(np.float32)
    sc = tiles[..., 64:192].reshape(2, 2, 8, 16).astype(np.float32)  # [T, S, g, row]
    m = tiles[..., 192:320].reshape(2, 2, 4, 16, 2).transpose(0, 1, 2, 4, 3).reshape(2, 2, 8, 16)
    qs = tiles[..., 320:].reshape(2, 2, 8, 4, 16, 4)  # [T, S, g, t, row, b]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # value 8 t + b, then 8 t + 4 + b
    q = q.transpose(0, 4, 1, 2, 3, 5).reshape(2, 16, 2, 8, 32).astype(np.float32)
    scale = (d[:, :, None] * sc).transpose(0, 3, 1, 2)[..., None]  # [T, row, S, g, 1]
    offset = (dmin[:, :, None] * m.astype(np.float32)).transpose(0, 3, 1, 2)[..., None]
    ours = (scale * q - offset).reshape(32, 512)
    assert np.array_equal(ours, reference.dequantize("Q4_K", raw))


def test_interleaved_q6_k_holds_the_files_values_where_its_layout_says():
    """As above for Q6_K: d sc(j) (v - 32), v's low 4 bits from A / B and its top 2 from H."""
    rng = np.random.default_rng(4)
    raw = random_rows("Q6_K", 16, 512, rng)
    tiles = interleave_q6_k(raw).reshape(2, 3360)  # [superblock, bytes], one tile
    assert np.array_equal(reference.deinterleave_q6_k(interleave_q6_k(raw)), raw)
    d = tiles[:, 0:32].copy().view(np.float16).astype(np.float32)  # [S, row]
    sc = tiles[:, 32:288].reshape(2, 8, 16, 2).transpose(0, 1, 3, 2).reshape(2, 16, 16)
    groups = tiles[:, 288:].reshape(2, 16, 3, 16, 4)  # [S, j, vector, row, b]
    a, b, h = groups[:, :, 0], groups[:, :, 1], groups[:, :, 2]  # [S, j, row, b]
    low = np.stack([a & 0xF, a >> 4, b & 0xF, b >> 4], axis=2)  # [S, j, quarter, row, b]
    top = np.stack([(h >> (2 * q)) & 3 for q in range(4)], axis=2)
    v = (low | (top << 4)).astype(np.float32) - 32  # value 16 j + 4 quarter + b
    scale = d[:, None] * sc.view(np.int8).astype(np.float32)  # [S, j, row]
    ours = scale[:, :, None, :, None] * v  # [S, j, quarter, row, b]
    ours = ours.transpose(3, 0, 1, 2, 4).reshape(16, 512)
    assert np.array_equal(ours, reference.dequantize("Q6_K", raw))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_interleaved_32_value_formats_hold_the_files_values_where_their_layouts_say(fmt):
    """As above for the 32-value formats: Q8_0's d (u - 128) with u the stored byte; Q5_0's
    d (v - 16), v's low 4 bits from the nibbles and its fifth from the block's masks; Q4_0's
    d (v - 8); Q4_1's d v + m."""
    raw = random_rows(fmt, 16, 64, np.random.default_rng(5))  # one tile of 2 blocks
    layout = INTERLEAVE[f"{fmt}_X16"](raw)
    assert np.array_equal(reference.DEINTERLEAVE[f"{fmt}_X16"](layout), raw)
    tiles = layout.reshape(2, -1)  # [block, bytes]
    d = tiles[:, 0:32].copy().view(np.float16).astype(np.float32)  # [block, row]
    m = np.zeros_like(d)
    if fmt == "Q8_0":
        u = tiles[:, 32:].reshape(2, 8, 16, 4).astype(np.float32) - 128  # [B, g, row, b]
        v = u.transpose(0, 2, 1, 3).reshape(2, 16, 32)  # value 4 g + b
    else:
        fifth = np.zeros((2, 16, 32), np.uint8)
        at = 32
        if fmt == "Q5_0":
            masks = tiles[:, 32:96].copy().view("<u8")  # [block, s]
            bits = (masks[:, :, None] >> np.arange(64, dtype=np.uint64)) & 1  # [B, s, 4 row + b]
            fifth = bits.reshape(2, 8, 16, 4).transpose(0, 2, 1, 3).reshape(2, 16, 32)
            at = 96
        if fmt == "Q4_1":
            m = tiles[:, 32:64].copy().view(np.float16).astype(np.float32)
            at = 64
        qs = tiles[:, at:].reshape(2, 4, 16, 4)  # [B, t, row, b]
        low = np.stack([qs & 0xF, qs >> 4], axis=2)  # [B, t, half, row, b]
        low = low.transpose(0, 3, 1, 2, 4).reshape(2, 16, 32)  # value 8 t + 4 half + b
        bias = {"Q5_0": 16, "Q4_0": 8, "Q4_1": 0}[fmt]
        v = (low | (fifth.astype(np.uint8) << 4)).astype(np.float32) - bias
    ours = (d[:, :, None] * v + m[:, :, None]).transpose(1, 0, 2).reshape(16, 64)
    assert np.array_equal(ours, reference.dequantize(fmt, raw))

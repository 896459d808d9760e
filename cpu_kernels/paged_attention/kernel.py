"""Ragged paged attention on XLA:CPU through the C++ kernel in kernel.cc (float32 queries over
a float32, int8 or fp8 cache), with the signature of
pallas_kernels.ragged_paged_attention.reference.

    load_paged_attention(build_dir)   # compiles kernel.cc once, registers it
    out = paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                          sm_scale=..., layer=layer)

T: tokens, H: query heads, K: kv heads, D: head dim, L: layers, NB: blocks, BS: block size,
R: requests, MB: blocks per request.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import KernelBuildError, build, load, register
from pallas_kernels.ragged_paged_attention.kv_quant import check_scale_layout

SOURCE = Path(__file__).with_name("kernel.cc")
TARGET = "jaxinfer_paged_attention"
QUANTIZED = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


def paged_attention(
    q: jax.Array,  # [T, H, D] float32
    kv_cache: jax.Array,  # [2, NB, BS, K, D], or [L, 2, NB, BS, K, D] with `layer`
    #                       float32, or int8 / fp8 with kv_scales
    block_tables: jax.Array,  # i32[R, MB]
    seq_lens: jax.Array,  # i32[R], context length including this step's tokens
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1], requests that are real (the rest are padding)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    kv_scales: jax.Array | None = None,  # int8: f32[(L,) 2, NB, BS, K]; fp8: f32[(L,) 2, K]
    kv_scale_layout: str | None = None,  # "token" (int8), "head" (fp8)
) -> jax.Array:  # [T, H, D]; zeros for padding tokens
    """Causal attention of each request's new tokens over its paged context (see
    load_paged_attention). The kernel reads int8 values with per-token scales and fp8 values
    with per-head scales; another pairing is an error."""
    quantized = kv_cache.dtype in QUANTIZED
    if q.dtype != jnp.float32 or not (kv_cache.dtype == jnp.float32 or quantized):
        raise TypeError(
            f"paged_attention takes float32 q and a float32, int8 or fp8 cache, got {q.dtype}, "
            f"{kv_cache.dtype}"
        )
    if quantized != (kv_scales is not None):
        raise TypeError("paged_attention: an int8 or fp8 cache comes with kv_scales (only)")
    check_scale_layout(kv_scale_layout, kv_scales, kv_cache)
    if quantized and kv_scale_layout != ("token" if kv_cache.dtype == jnp.int8 else "head"):
        raise TypeError(
            f"paged_attention reads {kv_cache.dtype} values with per-"
            f"{'token' if kv_cache.dtype == jnp.int8 else 'head'} scales, not per-{kv_scale_layout}"
        )
    if layer is None:
        kv_cache, layer = kv_cache[None], 0
        kv_scales = None if kv_scales is None else kv_scales[None]
    if kv_scales is None:
        kv_scales = jnp.zeros((0,), jnp.float32)
    i32 = jnp.int32
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q,
        kv_cache,
        kv_scales.astype(jnp.float32),
        block_tables.astype(i32),
        seq_lens.astype(i32),
        query_start_loc.astype(i32),
        jnp.asarray(num_seqs, i32).reshape(1),
        jnp.asarray(layer, i32),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
    )


def load_paged_attention(build_dir: Path):
    """`paged_attention`, ready to call: builds kernel.cc into `build_dir` if needed and
    registers it. KernelBuildError without a C++ compiler, or on a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_paged_attention_supported():
        raise KernelBuildError("the CPU attention kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferPagedAttention", TARGET)
    return paged_attention

"""Ragged paged attention on XLA:CPU through the C++ kernel in kernel.cc (float32), with the
signature of pallas_kernels.ragged_paged_attention.reference.

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

SOURCE = Path(__file__).with_name("kernel.cc")
TARGET = "jaxinfer_paged_attention"


def paged_attention(
    q: jax.Array,  # [T, H, D] float32
    kv_cache: jax.Array,  # [2, NB, BS, K, D], or [L, 2, NB, BS, K, D] with `layer`
    block_tables: jax.Array,  # i32[R, MB]
    seq_lens: jax.Array,  # i32[R], context length including this step's tokens
    query_start_loc: jax.Array,  # i32[R + 1]
    num_seqs: jax.Array,  # i32[1], requests that are real (the rest are padding)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:  # [T, H, D]; zeros for padding tokens
    """Causal attention of each request's new tokens over its paged context (see
    load_paged_attention)."""
    if q.dtype != jnp.float32 or kv_cache.dtype != jnp.float32:
        raise TypeError(
            f"paged_attention takes float32 q and cache, got {q.dtype}, {kv_cache.dtype}"
        )
    if layer is None:
        kv_cache, layer = kv_cache[None], 0
    i32 = jnp.int32
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q,
        kv_cache,
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

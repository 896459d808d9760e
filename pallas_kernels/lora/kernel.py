"""Batched LoRA (see reference.py) as a Pallas kernel for the GPU: each program computes a
[BT, BN] tile of y; it walks the adapter slots, skips those no row of its tile uses, and for
the others shrinks its rows (x @ a[s]^T, walking I in steps of BK), zeroes the rows of other
slots and expands into the tile (@ b[s][:, BN]). Rows of the base model (slot -1) get zeros.

T: rows, I: input, O: output, S: slots, R: rank, L: layers of stacked pairs, BT x BN: a
program's tile, BK: the shrink's step. R below 16 (Triton's smallest dot) is zero-padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.tiles import largest_power_of_two_divisor

BLOCK_T = 16
MIN_RANK = 16


def _lora_kernel(layer_ref, slots_ref, x_ref, a_ref, b_ref, y_ref, *, block_t, block_n, block_k):
    # layer_ref i32[1]; slots_ref i32[Tp]; x_ref [Tp, I]; a_ref [L, S, R, I];
    # b_ref [L, S, R, O]; y_ref [Tp, O]
    t, n = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(t * block_t, block_t), pl.ds(n * block_n, block_n)
    layer = layer_ref[0]
    slots = slots_ref[rows]  # [BT]
    num_slots, rank, depth = a_ref.shape[1], a_ref.shape[2], a_ref.shape[3]
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def one_slot(s, acc):
        mine = slots == s  # [BT]

        def add(acc):
            def shrink(k, u):
                reduce = pl.ds(k * block_k, block_k)
                x = x_ref[rows, reduce]  # [BT, BK]
                a = a_ref[layer, s, :, reduce]  # [R, BK]
                return u + jax.lax.dot_general(
                    x,
                    a,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )

            u = jax.lax.fori_loop(
                0, depth // block_k, shrink, jnp.zeros((block_t, rank), jnp.float32)
            )
            u = jnp.where(mine[:, None], u, 0.0).astype(x_ref.dtype)  # [BT, R]
            b = b_ref[layer, s, :, cols]  # [R, BN]
            return acc + jnp.dot(u, b, precision=precision, preferred_element_type=jnp.float32)

        used = jnp.sum(mine.astype(jnp.int32)) > 0  # (Triton lowers no reduce_or)
        return jax.lax.cond(used, add, lambda acc: acc, acc)

    acc = jax.lax.fori_loop(0, num_slots, one_slot, jnp.zeros((block_t, block_n), jnp.float32))
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def lora(
    x: jax.Array,  # [T, I]
    a: jax.Array,  # [S, R, I], or [L, S, R, I] with `layer`
    b: jax.Array,  # [S, R, O], or [L, S, R, O] with `layer`
    slots: jax.Array,  # i32[T], -1 for none
    *,
    layer: jax.Array | None = None,  # i32[]: the layer of stacked pairs, read in place
    interpret: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # [T, O]
    """The Pallas kernel with the reference's signature."""
    if layer is None:
        a, b, layer = a[None], b[None], 0
    num_rows, depth = x.shape
    rank, columns = b.shape[2], b.shape[3]
    if rank < MIN_RANK:  # (a copy of the small pair; only ranks below 16)
        pad = ((0, 0), (0, 0), (0, MIN_RANK - rank), (0, 0))
        a, b = jnp.pad(a, pad), jnp.pad(b, pad)
    block_n = largest_power_of_two_divisor(columns, 64)
    block_k = largest_power_of_two_divisor(depth, 64)
    if block_n < 16 or block_k < 16:
        raise ValueError(
            f"the LoRA kernel tiles I={depth} and O={columns} by powers of two of at least 16"
        )
    padded = -(-num_rows // BLOCK_T) * BLOCK_T
    x = jnp.pad(x, ((0, padded - num_rows), (0, 0)))
    slots = jnp.pad(slots.astype(jnp.int32), (0, padded - num_rows), constant_values=-1)
    kernel = functools.partial(_lora_kernel, block_t=BLOCK_T, block_n=block_n, block_k=block_k)
    y = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, columns), x.dtype),
        grid=(padded // BLOCK_T, columns // block_n),
        launch=launch,
        interpret=interpret,
        name="lora",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slots, x, a.astype(x.dtype), b.astype(x.dtype))
    return y[:num_rows]

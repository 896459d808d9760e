"""Batched LoRA (the S-LoRA / Punica product) as pure JAX: every row of a step times the
low-rank pair of the adapter its request uses, rows of many adapters (and of none) together.

    y[t] = (x[t] @ a[s]^T) @ b[s]    where s = slots[t]; y[t] = 0 where s < 0

T: rows, I: the projection's input, O: its output, S: adapter slots, R: the largest rank (a
smaller adapter's pair is zero-padded to it). `a` is the shrink [S, R, I] (PEFT's lora_A,
"out_in"), `b` the expand [S, R, O] (PEFT's lora_B transposed, its scaling folded in). With
`layer`, both are stacks over the model's layers ([L, S, ...]) and layer `layer` is used.

This reference is the dense form: every row through every slot, the slots a row does not use
masked to exact zeros before the expand (so a row's result does not depend on the other rows'
adapters). Its cost grows with S; the kernels beside it (cpu_kernels/lora, kernel.py here)
compute each row with its own slot only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_reference(
    x: jax.Array,  # [T, I]
    a: jax.Array,  # [S, R, I], or [L, S, R, I] with `layer`
    b: jax.Array,  # [S, R, O], or [L, S, R, O] with `layer`
    slots: jax.Array,  # i32[T], the row's adapter slot, -1 for none
    *,
    layer: jax.Array | None = None,  # i32[]
) -> jax.Array:  # [T, O], in x's dtype
    if layer is not None:
        a, b = a[layer], b[layer]
    num_slots = a.shape[0]
    onehot = slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)  # [T, S]
    shrunk = jnp.einsum("ti,sri->tsr", x, a.astype(x.dtype))  # [T, S, R]
    shrunk = jnp.where(onehot[..., None], shrunk, 0)
    return jnp.einsum("tsr,sro->to", shrunk, b.astype(x.dtype)).astype(x.dtype)


def lora_numpy(x, a, b, slots):
    """The same product row by row in numpy (float64), for tests."""
    import numpy as np

    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    y = np.zeros((x.shape[0], b.shape[-1]))
    for t, s in enumerate(np.asarray(slots)):
        if s >= 0:
            y[t] = (a[s] @ x[t]) @ b[s]
    return y

"""The gated delta rule on XLA:CPU through the C++ kernel in kernel.cc, with the signature of
pallas_kernels.gated_delta.reference.gated_delta_reference (float32): a request's decode
token in the recurrent form, a request's several tokens in the chunked (WY / UT) form, or
every token in the recurrent form with chunk=0 (batch_invariant: a token's arithmetic then
does not depend on how its request's tokens were split into steps):

    gated_delta = load_gated_delta(build_dir)   # compiles kernel.cc once, registers it
    o, states = gated_delta(q, k, v, g, beta, states, batch)

T: tokens, R: requests, Hk / Hv: key / value heads, Dk / Dv: head dims, S: state slots.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import KernelBuildError, build, load, register
from pallas_kernels.gated_delta.reference import CHUNK, StateBatch, per_request

SOURCE = Path(__file__).with_name("kernel.cc")
TARGET = "jaxinfer_gated_delta"


def gated_delta(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    *,
    qk_l2norm: bool = True,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    def kernel(q, k, v, g, beta, initial, query_start_loc, num_seqs):
        shapes = (
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
            jax.ShapeDtypeStruct(initial.shape, jnp.float32),
        )
        return jax.ffi.ffi_call(TARGET, shapes)(
            q,
            k,
            v,
            g,
            beta,
            initial,
            query_start_loc,
            num_seqs,
            chunk=np.int64(chunk),
            qk_l2norm=qk_l2norm,
        )

    return per_request(kernel, q, k, v, g, beta, states, batch, qk_l2norm, prepared=False)


def load_gated_delta(build_dir: Path):
    """`gated_delta`, ready to call: builds kernel.cc into `build_dir` if needed and
    registers it. KernelBuildError without a C++ compiler, or on a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_gated_delta_supported():
        raise KernelBuildError("the CPU gated delta kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferGatedDelta", TARGET)
    return gated_delta

"""A kernel tried once on the model's real shapes before the engine relies on it.

`probe_kernel` compiles a kernel of one kind (attention, ffn, norm, grouped_matmul,
int4_matmul) on a small input shaped like the model's (head_dim, query heads per KV head,
hidden, FFN and expert sizes, dtype) and compares it with the pure-JAX reference, computed at the highest matmul precision. Whatever goes wrong
(a Triton compile failure, a missing Pallas backend, a head size the kernel cannot tile, a
wrong result) comes back as a reason instead of an exception, so "auto" can fall back to the
reference at start-up rather than fail in warm-up (jaxinfer.config.resolve).

T: tokens, H: query heads, K: KV heads, D: head dim, E: hidden, I: FFN size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers.kv_cache import KVCacheFormat
from pallas_kernels.add_rms_norm.reference import add_rms_norm_reference
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.int4_matmul.reference import int4_matmul_reference
from pallas_kernels.int4_matmul.reference import quantize as int4_quantize
from pallas_kernels.ragged_paged_attention.kv_quant import quantize_cache
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

# Max abs error allowed, relative to the reference's largest magnitude (at least 1).
TOLERANCE = {"float32": 2e-3, "bfloat16": 6e-2, "float16": 1e-2}


def _attention_inputs(arch: LlamaConfig, dtype, block_size: int) -> tuple:
    """A decode over a context of two blocks and a bit, and a 5-token prefill chunk, with one
    padding request, over at most 2 KV heads."""
    rng = np.random.default_rng(0)
    kv_heads = min(2, arch.num_key_value_heads)
    group = arch.num_attention_heads // arch.num_key_value_heads
    context = [2 * block_size + 3, 5]
    q_lens = [1, 5]
    blocks = [-(-c // block_size) for c in context]
    num_blocks = 1 + sum(blocks)
    tables = np.zeros((3, max(blocks)), np.int32)
    tables[0, : blocks[0]] = 1 + np.arange(blocks[0])
    tables[1, : blocks[1]] = 1 + blocks[0] + np.arange(blocks[1])
    q = rng.standard_normal((sum(q_lens), group * kv_heads, arch.head_dim))
    kv = rng.standard_normal((2, num_blocks, block_size, kv_heads, arch.head_dim))
    return (
        jnp.asarray(q, dtype),  # [T, H, D]
        jnp.asarray(kv, dtype),  # [2, NB, BS, K, D]
        jnp.asarray(tables),  # [R, MB]
        jnp.asarray([*context, 0], np.int32),  # seq_lens
        jnp.asarray([0, 1, 6, 6], np.int32),  # query_start_loc
        jnp.asarray([2], np.int32),  # num_seqs
    )


def _inputs(
    kind: str, arch: LlamaConfig, dtype, block_size: int, kv_format: KVCacheFormat | None = None
) -> tuple[tuple, dict]:
    rng = np.random.default_rng(1)
    hidden, inter = arch.hidden_size, arch.intermediate_size
    if kind == "attention":
        args = _attention_inputs(arch, dtype, block_size)
        static = {"sm_scale": arch.head_dim**-0.5}
        if kv_format is not None and kv_format.quantized:  # the format the engine will run
            q, kv, *rest = args
            values, static["kv_scales"] = quantize_cache(kv, kv_format.name)
            static["kv_scale_layout"] = kv_format.scale_layout
            args = (q, values, *rest)
        return args, static
    if kind == "grouped_matmul":  # an expert's gate/up product over uneven groups
        experts = 4 if arch.moe is None else min(4, arch.moe.num_experts)
        inter = inter if arch.moe is None else arch.moe.intermediate_size
        x = rng.standard_normal((13, hidden))  # [M, E]
        w = rng.standard_normal((experts, hidden, 2 * inter)) * hidden**-0.5  # [G, E, 2I]
        sizes = jnp.asarray([5, 0, 7, 1][:experts], jnp.int32)
        return (jnp.asarray(x, dtype), jnp.asarray(w, dtype), sizes), {}
    if kind == "int4_matmul":  # the gate/up product in groups of 32
        x = rng.standard_normal((5, hidden))  # [T, E]
        w = rng.standard_normal((2 * inter, hidden)) * hidden**-0.5  # [2I, E]
        qs, scale, bias = int4_quantize(w, 32, symmetric=False)
        return (jnp.asarray(x, dtype), *(jnp.asarray(a) for a in (qs, scale, bias))), {}
    if kind == "ffn":
        x = rng.standard_normal((4, hidden))  # [T, E]
        gate_up = rng.standard_normal((hidden, 2, inter)) * hidden**-0.5  # [E, 2, I]
        down = rng.standard_normal((inter, hidden)) * inter**-0.5  # [I, E]
        return tuple(jnp.asarray(a, dtype) for a in (x, gate_up, down)), {}
    x, residual = rng.standard_normal((2, 4, hidden))  # [T, E] each
    weight = rng.standard_normal(hidden)
    args = tuple(jnp.asarray(a, dtype) for a in (x, residual, weight))
    return args, {"eps": arch.rms_norm_eps}


REFERENCES: dict[str, Callable] = {
    "attention": ragged_paged_attention_reference,
    "ffn": fused_ffn_reference,
    "norm": add_rms_norm_reference,
    "grouped_matmul": grouped_matmul_reference,
    "int4_matmul": int4_matmul_reference,
}


@dataclasses.dataclass(frozen=True)
class KernelCheck:
    """A kernel against its reference on inputs shaped like a model's."""

    reason: str | None  # None: it compiled and matched
    error: float | None = None  # max abs error against the reference (None: it did not run)
    bound: float | None = None  # the error allowed


def check_kernel(
    kind: str,
    kernel: Callable,
    arch: LlamaConfig,
    dtype: str,
    block_size: int,
    kv_format: KVCacheFormat | None = None,
) -> KernelCheck:
    """Compile `kernel` (of `kind`) on inputs shaped like the model's (an attention kernel over
    a cache in `kv_format`) and compare it with the reference at the highest matmul
    precision."""
    args, static = _inputs(kind, arch, jnp.dtype(dtype), block_size, kv_format)
    try:
        out = jax.block_until_ready(jax.jit(lambda *a: kernel(*a, **static))(*args))
    except Exception as error:  # anything the kernel's compiler or runtime raises
        text = " ".join(str(error).split())
        return KernelCheck(
            f"it failed on the model's shapes ({type(error).__name__}: {text[:300]})"
        )
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(lambda *a: REFERENCES[kind](*a, **static))(*args)
    worst, bound = 0.0, 0.0
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if got.shape != want.shape:
            return KernelCheck(f"it returned shape {got.shape}, the reference {want.shape}")
        error = float(np.max(np.abs(got - want))) if got.size else 0.0
        allowed = TOLERANCE[dtype] * max(1.0, float(np.max(np.abs(want))) if want.size else 0.0)
        if not error <= allowed:  # (NaN fails too)
            return KernelCheck(
                f"it differs from the reference by {error:.3g} on the model's shapes",
                error,
                allowed,
            )
        if error / allowed >= worst / max(bound, 1e-30):
            worst, bound = error, allowed
    return KernelCheck(None, worst, bound)


def probe_kernel(
    kind: str,
    kernel: Callable,
    arch: LlamaConfig,
    dtype: str,
    block_size: int,
    kv_format: KVCacheFormat | None = None,
) -> str | None:
    """None if `kernel` (of `kind`) compiles and matches the reference on inputs shaped like
    the model's, else why not."""
    return check_kernel(kind, kernel, arch, dtype, block_size, kv_format).reason

"""The mixture-of-experts FFN: route, sort the (token, expert) pairs by expert, run each
expert's gated FFN on its rows with grouped matmuls, and combine.

Cost follows the active experts: the T * k routed rows go through a grouped matmul that
multiplies each row by its own expert's weight only (a C++ kernel on CPU, a Pallas kernel on
GPU; the pure-JAX reference is jax.lax.ragged_dot, dense on XLA:CPU). Each row's products
and each token's combination (a sum over its k experts in their routing order) are computed
the same way wherever the token sits in the batch: permuting a batch's tokens permutes the
output rows exactly.

Parallelism (jaxinfer.parallel.sharding): the experts' weights are sharded over the mesh
either by expert ("experts", expert parallelism) or within each expert by its intermediate
axis ("expert_mlp", tensor parallelism). The step's tokens are on every device (the
attention's output is whole after its all-reduce); each device runs the rows routed to its
experts (EP) or its slice of every expert (TP), and one all-reduce sums the devices'
outputs.

T: tokens, E: hidden size, X: experts, k: experts per token, M = T * k routed rows,
I: an expert's intermediate size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers.invariant import tree_sum
from jaxinfer.layers.linear import OUT_IN, StackedWeight, dense_ffn, swiglu, unstacked
from jaxinfer.layers.moe.routing import route
from jaxinfer.layers.weights import Dense, GGUFWeight, Int4, Int8, dense
from jaxinfer.parallel.sharding import Partitioner
from pallas_kernels.grouped_matmul.reference import grouped_matmul_out_in_reference

# Logical axes of the MoE parameters of one layer in the loader's "in_out" layout (with the
# stacked layers' leading axis in models/llama.PARAM_AXES).
EXPERT_AXES = {
    "router": ("embed", None),  # [E, X], a float Dense weight (never quantized)
    "router_bias": (None,),  # [X]
    "experts_gate_up": ("experts", "embed", "gate_up", "expert_mlp"),  # [X, E, 2, I]
    "experts_down": ("experts", "expert_mlp", "embed"),  # [X, I, E]
    "shared_expert_gate": ("embed", None),  # [E, 1]
}
# Each expert projection's input axis, counted from the end ("in_out").
EXPERT_PROJECTIONS = {"experts_gate_up": -3, "experts_down": -2}
# Projections kept in float whatever the quantization (the router decides, and is small).
FLOAT_PROJECTIONS = {"router": -2}


def moe_ffn(
    config: LlamaConfig,
    p: dict,  # one layer's parameters
    x: jax.Array,  # [T, E], normed
    kernels,  # jaxinfer.layers.kernel_registry.ModelKernels
    partitioner: Partitioner | None = None,
) -> jax.Array:  # [T, E]
    moe = config.moe
    # The router in the model's dtype, as Hugging Face computes it, through the projection
    # path (the matmul kernel's fixed order under batch_invariant); scores in float32.
    logits = dense(x, p["router"], kernels).astype(jnp.float32)  # [T, X]
    weights, experts = route(logits, moe.router, p.get("router_bias"))  # [T, k] each
    y = routed_experts(
        x, weights, experts, p["experts_gate_up"], p["experts_down"], kernels, partitioner
    )
    if moe.shared_intermediate_size:
        shared = dense_ffn(x, p["gate_up_proj"], p["down_proj"], kernels)
        if moe.shared_expert_gate:
            # one output: a product and a fixed-tree row sum (XLA:CPU's matrix-vector product
            # sums a row differently by where it sits in the batch)
            w = p["shared_expert_gate"][:, 0].astype(jnp.float32)  # [E]
            gate = tree_sum(x.astype(jnp.float32) * w)[:, None]  # [T, 1]
            shared = shared * jax.nn.sigmoid(gate).astype(shared.dtype)
        y = y + shared
    return y


def routed_experts(
    x: jax.Array,  # [T, E]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k]
    gate_up,  # Dense / Int8: [X, E, 2, I] ("in_out") or [X, 2, I, E] ("out_in")
    down,  # [X, I, E] or [X, E, I]
    kernels,
    partitioner: Partitioner | None = None,
    limit: float | None = None,  # the gate's and up's clamp (MoeConfig.swiglu_limit)
) -> jax.Array:  # [T, E]
    num_experts = _num_experts(gate_up)
    if partitioner is None or partitioner.size == 1:
        return _experts(x, weights, experts, gate_up, down, kernels, 0, num_experts, None, limit)
    layout = kernels.weight_layout
    gate_up_spec = _spec(partitioner, gate_up, "experts_gate_up", layout)
    down_spec = _spec(partitioner, down, "experts_down", layout)
    sharded = any(_leaf_axes(spec) for spec in (gate_up_spec, down_spec))
    by_expert = _expert_sharded(gate_up_spec)
    axis = partitioner.mesh.axis_names[0]
    reduce = axis if sharded else None
    local = num_experts // partitioner.size if by_expert else num_experts

    def run(x, weights, experts, gate_up, down):
        first = jax.lax.axis_index(axis) * local if by_expert else 0
        return _experts(x, weights, experts, gate_up, down, kernels, first, local, reduce, limit)

    replicated = PartitionSpec()
    return jax.shard_map(
        run,
        mesh=partitioner.mesh,
        in_specs=(replicated, replicated, replicated, gate_up_spec, down_spec),
        out_specs=replicated,
        check_vma=False,
    )(x, weights, experts, gate_up, down)


def _experts(x, weights, experts, gate_up, down, kernels, first, count, reduce_axis, limit):
    """The rows routed to experts [first, first + count) (the local ones), combined per token
    and, with `reduce_axis`, summed over the devices."""
    tokens, k = experts.shape
    flat = experts.reshape(-1)  # [M], row t * k + j: token t's j-th expert
    order = jnp.argsort(flat, stable=True)  # routed rows sorted by expert, [M]
    local = flat - first
    in_range = (local >= 0) & (local < count)
    group_sizes = (
        jnp.zeros(count, jnp.int32).at[jnp.where(in_range, local, count)].add(1, mode="drop")
    )  # [count]
    # Rows of the local experts start after those of the experts before `first`.
    rows = order
    if not (isinstance(first, int) and first == 0):
        rows = jnp.roll(order, -jnp.sum((flat < first).astype(jnp.int32)))
    row_experts = jnp.clip(flat[rows] - first, 0, count - 1)  # [M], sorted
    # sorted row r holds token rows[r] // k, and its output goes back to row rows[r]
    h = grouped_project(x, gate_up, group_sizes, row_experts, kernels, x_rows=rows // k)
    act = swiglu(h[:, 0], h[:, 1], limit)  # [M, I], sorted
    ys = grouped_project(act, down, group_sizes, row_experts, kernels, y_rows=rows)  # [M, E]
    # Rows of other devices' experts are zero. Each token's k outputs, in routing order:
    ys = ys.reshape(tokens, k, -1)  # [T, k, E]
    out = ys[:, 0] * weights[:, 0, None].astype(ys.dtype)
    for j in range(1, k):
        out = out + ys[:, j] * weights[:, j, None].astype(ys.dtype)
    if reduce_axis is not None:
        out = jax.lax.psum(out, reduce_axis)
    return out


def grouped_project(
    x: jax.Array,  # [M, in] sorted by expert, or [X, in] gathered by x_rows
    weight,  # Dense / Int8 / Int4 over [X, ...], or a GGUFWeight of X experts
    group_sizes: jax.Array,  # i32[X]
    row_experts: jax.Array,  # i32[M], each sorted row's expert (for int8 scales)
    kernels,
    x_rows: jax.Array | None = None,  # i32[M]: sorted row r is x[x_rows[r]]
    y_rows: jax.Array | None = None,  # i32[M], a permutation: row r goes to y_rows[r]
) -> jax.Array:  # [M, *out]
    """Each row times its expert's weight: the C++ grouped kernel ("out_in" with the matmul
    kernel, which gathers and scatters the rows itself; the block kernel's for experts kept
    in GGUF blocks), the selected grouped kernel ("in_out"), or the reference."""
    layout, matmul = kernels.weight_layout, kernels.matmul
    if isinstance(weight, GGUFWeight):  # the block kernel's grouped product, nothing else
        if matmul is None or matmul.gguf_kernel is None:
            raise ValueError("experts in GGUF blocks need the C++ block kernel (gguf_weights)")
        y = matmul.grouped_blocks(x, weight, group_sizes, x_rows=x_rows, y_rows=y_rows)
        return y.astype(x.dtype)
    if isinstance(weight, Int4):
        if layout == OUT_IN and matmul is not None:
            return matmul.grouped_int4(x, weight, group_sizes, x_rows=x_rows, y_rows=y_rows)
        # the reference: the experts dequantized, then the float path
        weight = Dense(weight.dequantized(x.dtype), -1 if layout == OUT_IN else -2)
    scale = weight.scale if isinstance(weight, Int8) else None
    w = weight.q if isinstance(weight, Int8) else weight.w
    if layout == OUT_IN and matmul is not None:
        return matmul.grouped(x, w, group_sizes, scale, x_rows=x_rows, y_rows=y_rows)
    if x_rows is not None:
        x = jnp.take(x, x_rows, axis=0)
    w = unstacked(w)
    num_experts = w.shape[0]
    if layout == OUT_IN:  # [X, *out, in]
        out = w.shape[1:-1]
        flat = w.reshape(num_experts, -1, w.shape[-1])
        y = grouped_matmul_out_in_reference(x, flat, group_sizes)
    else:  # [X, in, *out]
        out = w.shape[2:]
        y = kernels.grouped_matmul(x, w.reshape(num_experts, w.shape[1], -1), group_sizes)
    y = y.reshape(x.shape[0], *out)
    if scale is not None:  # [X, *out]
        y = y * jnp.take(scale, row_experts, axis=0).astype(y.dtype)
    if y_rows is not None:  # the inverse permutation's gather
        inverse = (
            jnp.zeros_like(y_rows).at[y_rows].set(jnp.arange(y_rows.shape[0], dtype=y_rows.dtype))
        )
        y = jnp.take(y, inverse, axis=0)
    return y


def _num_experts(weight) -> int:
    if isinstance(weight, GGUFWeight):
        return weight.groups
    w = (
        weight.q
        if isinstance(weight, Int8)
        else weight.qs
        if isinstance(weight, Int4)
        else weight.w
    )
    return w.stacked.shape[1] if isinstance(w, StackedWeight) else w.shape[0]


def _spec(partitioner: Partitioner, weight, name: str, layout: str):
    """The weight's PartitionSpecs (a pytree like it) on the mesh."""
    in_out = dataclasses.replace(weight, input_axis=EXPERT_PROJECTIONS[name])
    axes = in_out.axes(EXPERT_AXES[name])  # the loader's layout's axes, then moved
    if layout == OUT_IN:
        axes = axes.to_out_in()
    arrays = jax.tree.leaves(weight)
    specs = [
        partitioner.spec(a, tuple(x.shape)) for a, x in zip(_axes_leaves(axes), arrays, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(weight), specs)


def _axes_leaves(axes) -> list[tuple]:
    return jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))


def _leaf_axes(spec) -> tuple:
    return tuple(a for s in jax.tree.leaves(spec, is_leaf=_is_spec) for a in s if a is not None)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _expert_sharded(spec) -> bool:
    first = jax.tree.leaves(spec, is_leaf=_is_spec)[0]
    return len(first) > 0 and first[0] is not None

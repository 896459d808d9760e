"""Projection weights as pytrees: one registered class per storage format.

A projection's weight is one of these objects, never a name plus suffixed companions. Each
format holds its arrays and says:

- `axes(weight_axes)`: the logical axes of each of its arrays (the same class holding tuples
  of axis names), from the logical axes of the float weight it stands for; the partitioner
  places each array by them (jaxinfer.parallel.sharding).
- `to_out_in()`: the weight in the "out_in" layout (jaxinfer.layers.linear), its input axis
  moved last.
- `in_place(layer)`: layer `layer` of weights stacked over the layers, as a layer scan hands
  it to a matmul kernel that reads the stack in place (linear.StackedWeight).
- `project(x, kernels)`: x [T, in] -> [T, *out], through the model's kernels
  (jaxinfer.layers.kernel_registry.ModelKernels: its weight layout, its matmul kernel).
- `scaled()`: (an array XLA multiplies, its per-output-channel scale or None), for the paths
  that fuse the scale themselves (the feature-major FFN, the LM head); `dequantized(dtype)`:
  the float weight, for kernels that take float weights; `rows(ids, dtype)`: rows of a
  vocabulary-major table (the embedding lookup).

`input_axis` (static) is the contracted axis counted from the end, so slicing off the leading
[L] axis keeps it. Adding a format is one class here plus its kernel.

E: hidden size, T: tokens, V: vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from cpu_kernels.gguf_matmul.kernel import gguf_rows
from jaxinfer.layers import linear
from jaxinfer.layers.linear import OUT_IN, StackedWeight
from pallas_kernels.int4_matmul import reference as int4_reference


def _moveaxis(a: Any, source: int) -> Any:
    """An array (or a tuple of axis names) with axis `source` moved last."""
    if isinstance(a, tuple):
        names = list(a)
        names.append(names.pop(source))
        return tuple(names)
    if source in (-1, a.ndim - 1):
        return a
    return a.transpose([i for i in range(a.ndim) if i != source % a.ndim] + [source % a.ndim])


def _without(axes: tuple, axis: int) -> tuple:
    names = list(axes)
    del names[axis]
    return tuple(names)


def _in_place(a, layer):
    return StackedWeight(a, layer)


def _weight_class(cls):
    """A frozen dataclass registered as a pytree; `input_axis` (and any field named in the
    class's STATIC) is static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    static = ["input_axis", *getattr(cls, "STATIC", ())]
    data = [f.name for f in dataclasses.fields(cls) if f.name not in static]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=static)


class _FloatWeight:
    """What the formats that keep a float weight `w` share: XLA's paths take `w` itself."""

    def scaled(self):
        return self.w, None

    def dequantized(self, dtype):
        return self.w

    def rows(self, ids, dtype):
        return self.w[ids]


@_weight_class
class Dense(_FloatWeight):
    """A float weight ([*lead, in, *out] in "in_out", [*lead, *out, in] in "out_in")."""

    w: Any
    input_axis: int = -2

    @property
    def size(self) -> int:  # values of the weight it stands for
        return self.w.size

    def axes(self, weight_axes: tuple) -> Dense:
        return Dense(weight_axes, self.input_axis)

    def to_out_in(self) -> Dense:
        return Dense(_moveaxis(self.w, self.input_axis), -1)

    def in_place(self, layer) -> Dense:
        return Dense(_in_place(self.w, layer), self.input_axis)

    def project(self, x, kernels):
        if kernels.weight_layout == OUT_IN and kernels.matmul is not None:
            return kernels.matmul.float32(x, self.w)
        return linear.xla_dense(x, self.w, kernels.weight_layout)


@_weight_class
class Int8:
    """Weight-only int8 with a float32 scale per output channel: W ~= q * scale
    (jaxinfer.layers.quantization)."""

    q: Any  # int8, the float weight's shape
    scale: Any  # f32, the weight's shape without the input axis
    input_axis: int = -2

    @property
    def size(self) -> int:  # values of the weight it stands for
        return self.q.size

    def axes(self, weight_axes: tuple) -> Int8:
        return Int8(weight_axes, _without(weight_axes, self.input_axis), self.input_axis)

    def to_out_in(self) -> Int8:
        return Int8(_moveaxis(self.q, self.input_axis), self.scale, -1)

    def in_place(self, layer) -> Int8:
        return Int8(_in_place(self.q, layer), self.scale[layer], self.input_axis)

    def project(self, x, kernels):
        if kernels.weight_layout == OUT_IN and kernels.matmul is not None:
            return kernels.matmul.int8(x, self.q, self.scale)
        return linear.xla_dense(x, self.q, kernels.weight_layout, self.scale)

    def scaled(self):
        return self.q, self.scale

    def dequantized(self, dtype):
        scale = jnp.expand_dims(self.scale, self.input_axis)
        return self.q.astype(dtype) * scale.astype(dtype)

    def rows(self, ids, dtype):
        return self.q[ids].astype(dtype) * self.scale[ids][:, None].astype(dtype)


@_weight_class
class GGUFWeight:
    """A weight kept in a GGUF file's own blocks, as the file stores them (Q4_0 ... Q6_K;
    layout: cpu_kernels.gguf_matmul.reference): each layer's rows as bytes, with a table of
    the runs of rows in one format (a fused projection's parts may differ, and so may layers).
    Every product goes through the block kernel (ModelKernels.matmul.blocks, the C++ kernel of
    cpu_kernels.gguf_matmul); the arrays are replicated (the kernel runs on one device).
    `layer` picks one layer of the stack: i32[L] (0 .. L - 1) as loaded, so that slicing the
    layers off the stack slices it too; a scalar once `in_place` sets it under the layer scan.
    A MoE layer's experts are `groups` weights per layer (layer l's expert g at l * groups +
    g), multiplied by the kernel's grouped product (ModelKernels.matmul.grouped_blocks).
    There is no array XLA's paths could take (OWN_KERNEL): `dequantized` asks the kernel for
    every row."""

    data: Any  # u8[L G, B] (u8[B] when a scan has sliced the layer out)
    table: Any  # i32[L G, S, 3], or [S, 3]
    layer: Any  # i32[L], or i32[] (in_place)
    out: tuple  # the output axes (their product: the rows of a layer's weight)
    k: int  # the input size
    input_axis: int = -1
    groups: int = 1  # G: weights per layer (a MoE layer's experts)

    OWN_KERNEL = True
    STATIC = ("out", "k", "groups")

    @property
    def size(self) -> int:  # values of the weight it stands for (one layer's times L)
        weights = self.data.shape[0] if self.data.ndim == 2 else 1
        return weights * math.prod(self.out) * self.k

    def axes(self, weight_axes: tuple) -> GGUFWeight:
        return GGUFWeight((), (), (), self.out, self.k, self.input_axis, self.groups)

    def to_out_in(self) -> GGUFWeight:
        return self

    def in_place(self, layer) -> GGUFWeight:
        return dataclasses.replace(self, layer=layer)

    def stacked(self) -> tuple[Any, Any, Any]:
        """(data [L G, B], table [L G, S, 3], layer i32[]): one layer sliced off the stack
        given its axis back; an unstacked weight (L = 1) its only layer."""
        if self.data.ndim == 1:
            return self.data[None], self.table[None], jnp.int32(0)
        if jnp.ndim(self.layer) == 0:
            return self.data, self.table, self.layer
        if self.data.shape[0] != self.groups:
            raise ValueError("a GGUFWeight of several layers is read one layer at a time")
        return self.data, self.table, jnp.int32(0)

    def project(self, x, kernels):
        if kernels.matmul is None:
            raise ValueError("GGUF block weights need the C++ block kernel (gguf_weights)")
        if self.groups != 1:
            raise ValueError("a GGUFWeight of experts is multiplied by group (grouped_blocks)")
        y = kernels.matmul.blocks(x, self)  # [T, N]
        return y.reshape(x.shape[0], *self.out).astype(x.dtype)

    def scaled(self):
        return self.dequantized(jnp.float32), None

    def dequantized(self, dtype):  # [*out, K], or [G, *out, K] for experts
        n = math.prod(self.out)
        data, table, layer = self.stacked()
        ids = jnp.arange(n)
        weights = [
            gguf_rows(ids, data, table, layer * self.groups + g, k=self.k)
            for g in range(self.groups)
        ]
        w = weights[0] if self.groups == 1 else jnp.stack(weights)
        return w.reshape(*w.shape[:-2], *self.out, self.k).astype(dtype)

    def rows(self, ids, dtype):
        data, table, layer = self.stacked()
        return gguf_rows(ids.reshape(-1), data, table, layer, k=self.k).astype(dtype)


@_weight_class
class Int4:
    """4-bit weights in groups of G along the input axis: W = q * scale + bias per group
    (the format: pallas_kernels.int4_matmul.reference). The arrays keep the input axis last
    in either layout (the values are packed along it); `input_axis` is where it stands in the
    float weight this one stands for, which `dequantized` returns. Every product goes through
    the C++ matmul kernel where the model has one ("out_in"), else the model's int4 kernel
    (ModelKernels.int4_matmul): there is no array XLA's paths could take (OWN_KERNEL)."""

    qs: Any  # u8[*lead, *out, in / 2]
    scale: Any  # f32 or f16 [*lead, *out, in / G]
    bias: Any  # the same
    input_axis: int = -1

    OWN_KERNEL = True

    @property
    def size(self) -> int:  # values of the weight it stands for
        return 2 * self.qs.size

    @property
    def group_size(self) -> int:
        qs = self.qs.stacked if isinstance(self.qs, StackedWeight) else self.qs
        scale = self.scale.stacked if isinstance(self.scale, StackedWeight) else self.scale
        return 2 * qs.shape[-1] // scale.shape[-1]

    def axes(self, weight_axes: tuple) -> Int4:
        packed = _moveaxis(weight_axes, self.input_axis)
        return Int4(packed, packed, packed, self.input_axis)

    def to_out_in(self) -> Int4:
        return Int4(self.qs, self.scale, self.bias, -1)

    def in_place(self, layer) -> Int4:
        return Int4(
            _in_place(self.qs, layer),
            _in_place(self.scale, layer),
            _in_place(self.bias, layer),
            self.input_axis,
        )

    def project(self, x, kernels):
        if isinstance(self.qs, StackedWeight):
            out = self.qs.stacked.shape[1:-1]
        else:
            out = self.qs.shape[:-1]
        if kernels.matmul is not None and kernels.weight_layout == OUT_IN:
            y = kernels.matmul.int4(x, self)  # the C++ kernel, stacked weights read in place
        else:
            qs, scale, bias = (linear.unstacked(a) for a in (self.qs, self.scale, self.bias))
            y = kernels.int4_matmul(x, qs, scale, bias)
        return y.reshape(x.shape[0], *out).astype(x.dtype)  # [T, *out]

    def dequantized(self, dtype):
        w = int4_reference.dequantize(
            linear.unstacked(self.qs), linear.unstacked(self.scale), linear.unstacked(self.bias)
        )
        if self.input_axis != -1:
            w = jnp.moveaxis(w, -1, self.input_axis)
        return w.astype(dtype)

    def rows(self, ids, dtype):
        return int4_reference.dequantize(self.qs[ids], self.scale[ids], self.bias[ids]).astype(
            dtype
        )


@dataclasses.dataclass(frozen=True)
class Int4Parts:
    """An Int4 weight while the loader assembles it (a quantized checkpoint's projection,
    jaxinfer.model_loader.quantized_checkpoint): its three arrays in the loader's "in_out"
    axes, the packed input axis (K / 2 values for qs, K / G for scale and bias) where the float
    weight has its input axis. `map` applies one array operation to each (transposes, fusing
    QKV, stacking layers), as the loader does to float weights."""

    qs: Any
    scale: Any
    bias: Any

    def map(self, fn, *others: Int4Parts) -> Int4Parts:
        arrays = zip(
            (self.qs, self.scale, self.bias),
            *((o.qs, o.scale, o.bias) for o in others),
            strict=True,
        )
        return Int4Parts(*(fn(*a) for a in arrays))

    @property
    def T(self) -> Int4Parts:
        return self.map(lambda a: a.T)

    def weight(self, input_axis: int) -> Int4:
        """The Int4 weight whose float weight has its input axis at `input_axis`."""
        return Int4(
            *(_moveaxis(a, input_axis) for a in (self.qs, self.scale, self.bias)), input_axis
        )


def mapped(fn, *arrays):
    """fn(*arrays) on float arrays, or on each of Int4Parts' arrays."""
    if isinstance(arrays[0], Int4Parts):
        return arrays[0].map(fn, *arrays[1:])
    return fn(*arrays)


FORMATS = (Dense, Int8, GGUFWeight, Int4)


def dense(x, weight, kernels):
    """x [T, in] times a projection weight of any format -> [T, *out], in the model's weight
    layout and through its matmul kernel where it has one (ModelKernels)."""
    return weight.project(x, kernels)


def is_weight(x) -> bool:
    return isinstance(x, FORMATS)

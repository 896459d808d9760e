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
from typing import Any

import jax
import jax.numpy as jnp

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
    """A frozen dataclass registered as a pytree; `input_axis` is static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    data = [f.name for f in dataclasses.fields(cls) if f.name != "input_axis"]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=["input_axis"])


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
class GGUFBlocks(_FloatWeight):
    """A float32 "out_in" weight kept together with the GGUF file's own Q4_1 or Q8_0 blocks
    that dequantize to it bit for bit (jaxinfer.model_loader.gguf_blocks): the block kernel
    (cpu_kernels.gguf_matmul) multiplies the blocks, a quarter of the bytes, for steps of a few
    rows; every other product takes the float weight. The blocks are replicated (the kernel
    runs on one device)."""

    w: Any  # f32[*lead, *out, in]
    qs: Any  # Q4_1: u8[*lead, N, in / 2]; Q8_0: i8[*lead, N, in]  (N: the outputs, flat)
    scales: Any  # Q4_1: f32[*lead, N, in / 32, 2]; Q8_0: f32[*lead, N, in / 32]
    input_axis: int = -1

    @property
    def fmt(self) -> str:
        qs = self.qs.stacked if isinstance(self.qs, StackedWeight) else self.qs
        return "Q8_0" if jnp.dtype(qs.dtype) == jnp.int8 else "Q4_1"

    @property
    def size(self) -> int:  # values of the weight it stands for
        return self.w.size

    def axes(self, weight_axes: tuple) -> GGUFBlocks:
        return GGUFBlocks(weight_axes, (), (), self.input_axis)

    def to_out_in(self) -> GGUFBlocks:
        return self

    def in_place(self, layer) -> GGUFBlocks:
        return GGUFBlocks(
            _in_place(self.w, layer),
            _in_place(self.qs, layer),
            _in_place(self.scales, layer),
            self.input_axis,
        )

    def project(self, x, kernels):
        if kernels.matmul is None:
            return linear.xla_dense(x, self.w, kernels.weight_layout)
        return kernels.matmul.blocks(x, self)


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


FORMATS = (Dense, Int8, GGUFBlocks, Int4)


def dense(x, weight, kernels):
    """x [T, in] times a projection weight of any format -> [T, *out], in the model's weight
    layout and through its matmul kernel where it has one (ModelKernels)."""
    return weight.project(x, kernels)


def is_weight(x) -> bool:
    return isinstance(x, FORMATS)

"""The start-up probe of a kernel on the model's shapes: a kernel that runs and matches the
reference passes; one that fails to run, or computes something else, gives a reason."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import pytest

from jaxinfer.layers.kernel_probe import probe_kernel
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.models.shapes import shape
from pallas_kernels.add_rms_norm.kernel import add_rms_norm
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

# The default model's shapes, with a smaller FFN to keep the interpreter quick.
ARCH = dataclasses.replace(shape("smollm2"), intermediate_size=256)
KERNELS = {
    "attention": ragged_paged_attention,
    "ffn": fused_ffn,
    "norm": add_rms_norm,
}


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_the_pallas_kernels_pass_interpreted(kind):
    kernel = functools.partial(KERNELS[kind], interpret=True)
    assert probe_kernel(kind, kernel, ARCH, "float32", 16) is None


@pytest.mark.parametrize(
    "kv_cache_dtype", ["int8", pytest.param("fp8_e4m3", marks=pytest.mark.slow)]
)
def test_attention_is_probed_over_the_engines_cache_format(kv_cache_dtype):
    kernel = functools.partial(ragged_paged_attention, interpret=True)
    kv_format = KVCacheFormat.resolve(kv_cache_dtype, "float32")
    assert probe_kernel("attention", kernel, ARCH, "float32", 16, kv_format) is None

    def ignores_scales(q, kv, *rest, kv_scales, kv_scale_layout, **kwargs):  # codes as values
        return kernel(q, kv.astype(jnp.float32), *rest, **kwargs)

    reason = probe_kernel("attention", ignores_scales, ARCH, "float32", 16, kv_format)
    assert "differs from the reference" in reason


def test_a_wrong_or_failing_kernel_gives_a_reason():
    def wrong(x, gate_up, down):
        return jnp.zeros((x.shape[0], down.shape[1]), x.dtype)

    def failing(x, residual, weight, *, eps):
        raise NotImplementedError("no Pallas Triton backend")

    assert "differs from the reference" in probe_kernel("ffn", wrong, ARCH, "float32", 16)
    reason = probe_kernel("norm", failing, ARCH, "bfloat16", 16)
    assert "failed on the model's shapes (NotImplementedError: no Pallas Triton backend)" in reason

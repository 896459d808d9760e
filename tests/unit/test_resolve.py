"""The one resolution step: every "auto" settled from the options and the platform, with why."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cpu_kernels.matmul.kernel import matmul
from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config import EngineOptions
from jaxinfer.config.platform import Platform
from jaxinfer.config.resolve import resolve
from jaxinfer.layers.kernel_registry import default_registry
from jaxinfer.layers.native_kernels import KernelMatmul
from jaxinfer.layers.pallas_matmul import PallasMatmul
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

ARCH = LlamaConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=False,
)
# A CPU that cannot build the C++ kernels: nothing is compiled by the tests that use it.
NO_NATIVE = Platform("cpu", 1, frozenset({"sse2"}), "g++", Path("/nonexistent"))
GPU = Platform("gpu", 1, frozenset(), None, Path("/nonexistent"))


def passes(kind, kernel, arch, dtype, block_size, kv_cache_dtype):  # every kernel passes
    return None


def settle(platform: Platform, **options):
    return resolve(EngineOptions(**options), platform, ARCH, default_registry(), probe=passes)


def test_cpu_without_the_kernels_records_why():
    resolution = settle(NO_NATIVE)
    resolved = resolution.options
    assert (resolved.dtype, resolved.attention, resolved.ffn, resolved.norm) == (
        "float32",
        "reference",
        "reference",
        "reference",
    )
    assert (resolved.weight_layout, resolved.matmul, resolved.gguf_blocks) == (
        "out_in",
        "xla",
        False,
    )
    assert (resolved.layer_execution, resolved.async_scheduling) == ("per_layer", False)
    assert resolved.weight_format == "dense"
    assert settle(NO_NATIVE, quantization="int8").options.weight_format == "int8"
    described = resolved.describe()
    assert "lacks AVX2" in described["matmul"]["reason"]
    assert "lacks AVX2" in described["attention"]["reason"]
    assert "matmul kernel" in described["gguf_blocks"]["reason"]
    assert resolution.kernels.matmul is None
    assert resolution.kernels.attention is ragged_paged_attention_reference
    # an explicit choice is kept, and has no reason
    explicit = settle(NO_NATIVE, layer_execution="scan", dtype="bfloat16").options.describe()
    assert explicit["layer_execution"] == {"value": "scan"}
    assert explicit["dtype"] == {"value": "bfloat16"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"matmul_impl": "cpu"}, "matmul_impl 'cpu' cannot be used here: .*lacks AVX2"),
        ({"attention_impl": "cpu"}, "attention_impl 'cpu' cannot be used here"),
        ({"gguf_weights": "on"}, "gguf_weights 'on' cannot be used here: .*matmul kernel"),
        ({"attention_impl": "flash9"}, "no attention kernel named 'flash9'"),
        ({"ffn_impl": "pallas", "weight_layout": "out_in"}, "'out_in' runs the reference FFN"),
        ({"ffn_impl": "pallas", "tensor_parallel_size": 2}, "tensor parallelism"),
    ],
)
def test_asking_for_what_cannot_run_is_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        settle(NO_NATIVE, **options)


def test_one_gpu_takes_the_pallas_kernels():
    resolution = settle(GPU)
    resolved = resolution.options
    assert (resolved.dtype, resolved.attention, resolved.ffn, resolved.norm) == (
        "bfloat16",
        "pallas",
        "pallas",
        "pallas",
    )
    assert (resolved.weight_layout, resolved.matmul, resolved.layer_execution) == (
        "in_out",
        "xla",
        "scan",
    )
    assert resolved.async_scheduling
    assert resolution.kernels.ffn is fused_ffn
    assert "XLA:CPU, not gpu" in resolved.describe()["matmul"]["reason"]
    tp2 = settle(dataclasses.replace(GPU, num_devices=2), tensor_parallel_size=2).options
    assert (tp2.attention, tp2.ffn) == ("reference", "reference")


def test_cpu_with_the_kernels_takes_them(cpu_kernel_dir):
    platform = Platform.detect(cpu_kernel_dir.parent)
    platform = dataclasses.replace(platform, native_dir=cpu_kernel_dir)
    resolution = settle(platform)
    resolved = resolution.options
    assert (resolved.attention, resolved.matmul, resolved.layer_execution) == (
        "cpu",
        "cpu",
        "scan",
    )
    assert isinstance(resolution.kernels.matmul, KernelMatmul)
    assert resolution.kernels.matmul.kernel is matmul
    assert resolution.kernels.ffn is fused_ffn_reference
    # no GGUF file to take blocks from: "auto" goes without, "on" is a clear error
    assert not resolved.gguf_blocks
    with pytest.raises(ValueError, match="not converted from a GGUF"):
        settle(platform, gguf_weights="on")
    for change, reason in (
        ({"tensor_parallel_size": 2}, "one device"),
        ({"weight_layout": "in_out"}, "'out_in' weight layout"),
        ({"dtype": "bfloat16"}, "float32 activations, not bfloat16"),
    ):
        other = settle(platform, **change).options
        assert other.matmul == "xla" and reason in other.describe()["matmul"]["reason"]
        with pytest.raises(ValueError, match=reason):
            settle(platform, matmul_impl="cpu", **change)
    assert settle(platform, matmul_impl="xla").options.layer_execution == "per_layer"


def test_a_gpu_kernel_that_fails_its_probe_falls_back_to_the_reference():
    probed = []

    def probe(kind, kernel, arch, dtype, block_size, kv_cache_dtype):
        probed.append((kind, dtype, block_size))
        return "it failed on the model's shapes (TritonError: no)" if kind == "attention" else None

    resolution = resolve(EngineOptions(), GPU, ARCH, default_registry(), probe=probe)
    resolved = resolution.options
    assert sorted(probed) == [
        ("attention", "bfloat16", 16),
        ("ffn", "bfloat16", 16),
        ("norm", "bfloat16", 16),
    ]
    assert (resolved.attention, resolved.ffn, resolved.norm) == ("reference", "pallas", "pallas")
    assert resolution.kernels.attention is ragged_paged_attention_reference
    assert "TritonError" in resolved.describe()["attention"]["reason"]
    with pytest.raises(ValueError, match=r"attention_impl 'pallas' cannot run here: .*Triton"):
        resolve(EngineOptions(attention_impl="pallas"), GPU, ARCH, default_registry(), probe=probe)
    # on CPU nothing is probed (the Pallas kernels are not picked there)
    probed.clear()
    resolve(EngineOptions(), NO_NATIVE, ARCH, default_registry(), probe=probe)
    assert probed == []


def test_int4_kernel_choices_and_refusals():
    """int4: the reference off the C++ kernel on CPU, Pallas on one GPU; int8_activations
    only with int4 weights in the C++ kernel; int8 never over an AWQ/GPTQ checkpoint."""
    from jaxinfer.arch_config import CheckpointQuantization
    from pallas_kernels.int4_matmul.kernel import int4_matmul
    from pallas_kernels.int4_matmul.reference import int4_matmul_reference

    cpu = settle(NO_NATIVE, quantization="int4", quantization_group_size=64)
    assert cpu.options.weight_format == "int4 (groups of 64)"
    assert (cpu.options.int4_matmul, cpu.kernels.int4_matmul) == (
        "reference",
        int4_matmul_reference,
    )
    gpu = settle(GPU, quantization="int4")
    assert (gpu.options.int4_matmul, gpu.kernels.int4_matmul) == ("pallas", int4_matmul)
    assert settle(GPU).options.int4_matmul == "reference"  # nothing to choose without int4
    with pytest.raises(ValueError, match="int8_activations"):
        settle(NO_NATIVE, int8_activations=True)
    with pytest.raises(ValueError, match="int8_activations"):
        settle(NO_NATIVE, quantization="int4", int8_activations=True)  # no C++ kernel here
    awq = dataclasses.replace(ARCH, quantization=CheckpointQuantization("awq", 128))
    resolved = resolve(EngineOptions(), NO_NATIVE, awq, default_registry(), probe=passes)
    assert resolved.options.weight_format == "awq int4 (groups of 128)"
    with pytest.raises(ValueError, match="quantization 'int8'"):
        resolve(EngineOptions(quantization="int8"), NO_NATIVE, awq, default_registry())


def test_warmup_in_the_background_only_where_it_can_run():
    gpu = settle(GPU, warmup="auto").options
    assert gpu.warmup == "background"
    assert gpu.describe()["warmup"]["reason"] == "one process, layers under a scan"
    assert settle(GPU).options.warmup == "all"  # the default: everything before serving
    lockstep = dataclasses.replace(GPU, num_processes=2)
    assert settle(lockstep, warmup="auto").options.warmup == "all"
    per_layer = settle(NO_NATIVE, warmup="auto").options  # XLA:CPU without the kernels
    assert per_layer.warmup == "all"
    assert "per-layer" in per_layer.describe()["warmup"]["reason"]
    with pytest.raises(ValueError, match="warmup 'background' cannot be used here: several"):
        settle(lockstep, warmup="background")


def test_batch_invariant_on_a_gpu_takes_the_pallas_kernels_in_fixed_order():
    resolution = settle(GPU, batch_invariant=True)
    resolved = resolution.options
    chosen = (resolved.matmul, resolved.attention, resolved.norm, resolved.ffn)
    assert chosen == ("pallas", "pallas", "pallas", "reference")
    assert resolved.weight_layout == "out_in"
    assert isinstance(resolution.kernels.matmul, PallasMatmul)
    assert not resolution.kernels.matmul.interpret
    assert resolution.kernels.attention.keywords == {"batch_invariant": True}
    assert "batch_invariant" in resolved.describe()["matmul"]["reason"]
    with pytest.raises(ValueError, match="takes float weights"):
        settle(GPU, batch_invariant=True, quantization="int8")
    with pytest.raises(ValueError, match="batch_invariant needs matmul_impl"):
        settle(GPU, batch_invariant=True, matmul_impl="xla")
    with pytest.raises(ValueError, match="compiles for a GPU"):
        settle(NO_NATIVE, matmul_impl="pallas")
    interpreted = settle(
        NO_NATIVE,
        batch_invariant=True,
        matmul_impl="pallas_interpret",
        attention_impl="pallas_interpret",
    )
    assert interpreted.options.matmul == "pallas_interpret"
    assert interpreted.kernels.matmul.interpret


def test_lora_kernel_choices():
    from pallas_kernels.lora.reference import lora_reference

    assert settle(NO_NATIVE).options.lora is None  # off without enable_lora
    with pytest.raises(ValueError, match="only used with enable_lora"):
        settle(NO_NATIVE, lora_impl="reference")
    cpu = settle(NO_NATIVE, enable_lora=True)
    assert cpu.options.lora == "reference" and cpu.kernels.lora is lora_reference
    assert "lacks AVX2" in cpu.options.describe()["lora"]["reason"]
    gpu = settle(GPU, enable_lora=True)
    assert gpu.options.lora == "pallas"
    odd = dataclasses.replace(ARCH, intermediate_size=72)  # gate/up/down not tiled by 16
    resolution = resolve(
        EngineOptions(enable_lora=True), GPU, odd, default_registry(), probe=passes
    )
    assert resolution.options.lora == "reference"
    assert "gate_proj, up_proj, down_proj" in resolution.options.describe()["lora"]["reason"]
    with pytest.raises(ValueError, match="batch_invariant: the reference LoRA product"):
        settle(GPU, enable_lora=True, lora_impl="reference", batch_invariant=True)
    with pytest.raises(ValueError, match="runs on one GPU"):
        settle(NO_NATIVE, enable_lora=True, lora_impl="pallas")

"""The one place where "auto" is settled: EngineOptions and the Platform (plus the model's
shape and the kernel registry) in, a frozen ResolvedOptions and the ModelKernels out.

On a GPU each Pallas kernel chosen is first probed on the model's shapes
(jaxinfer.layers.kernel_probe): "auto" falls back to the reference where one fails, logging
why; an explicit "pallas" that fails is a clear error. Every choice made from "auto" records why; `ResolvedOptions.describe()` is what the engine
logs at start-up and the server returns at GET /v1/engine. Nothing downstream decides again.

The C++ kernels for XLA:CPU (cpu_kernels) need XLA:CPU, float32 activations and one device
(XLA cannot split a custom call over a mesh), and a C++ compiler to build them once:
- matmul "cpu": the "out_in" projections and LM head, token-major (no transposes), int8 read
  as int8; float32 products of prefill-sized chunks stay on XLA's GEMM
  (jaxinfer.layers.native_kernels.KernelMatmul).
- attention "cpu": ragged paged attention walking each request's blocks with an online
  softmax (head_dim a multiple of 8 up to 256, block_size up to 128).
- GGUF blocks: beside the matmul kernel, the Q4_1 and Q8_0 blocks of the GGUF file the
  float32 weights were dequantized from, multiplied directly for steps of 1-3 tokens
  (bit-identical products from a quarter of the bytes; jaxinfer.layers.gguf_weights).

batch_invariant (CPU): every product through the C++ matmul kernel in its fixed order (one FMA
chain over K per output, for every row count; no XLA GEMM, no GGUF blocks), attention through
the C++ kernel (each row's softmax walks its own positions in one order, whatever shares its
item or step), norms through the "invariant" reference (jaxinfer.layers.invariant) and the
sampler's sums as fixed trees. A choice outside INVARIANT_KERNELS is a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError
from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.options import EngineOptions, quantization_of
from jaxinfer.config.platform import Platform
from jaxinfer.layers.kernel_probe import probe_kernel
from jaxinfer.layers.kernel_registry import KernelRegistry, ModelKernels
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.layers.linear import IN_OUT, OUT_IN
from jaxinfer.layers.native_kernels import KernelMatmul
from pallas_kernels.fused_ffn.reference import fused_ffn_reference

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """Every choice EngineOptions left to the engine, settled."""

    dtype: str
    attention: str  # a KernelRegistry name ("cpu": the C++ kernel)
    ffn: str
    norm: str
    grouped_matmul: str  # the MoE experts' product: "cpu" (C++, "out_in") or a registry name
    weight_layout: str  # "in_out" or "out_in"
    weight_format: str  # the projections' format: "dense" (in dtype) or the quantization
    int4_matmul: str  # int4 weights' product: "cpu" (C++, "out_in") or a registry name
    matmul: str  # "cpu" (the C++ kernel) or "xla"
    gguf_blocks: bool  # keep the source GGUF file's blocks where they are exact
    gguf_blocks_required: bool  # gguf_weights "on": finding none is an error
    layer_execution: str  # "scan" or "per_layer"
    async_scheduling: bool
    batch_invariant: bool  # every kernel reduces in an order fixed per token
    speculative_free_tokens: int  # proposals may grow a step up to this many tokens
    warmup: str  # "all" or "background" (token buckets compiled while serving)
    compilation_cache_dir: str | None  # None: no persistent compilation cache
    reasons: tuple[tuple[str, str], ...] = ()  # (choice, why), for choices made from "auto"

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def describe(self) -> dict:
        """{choice: {"value": ..., "reason": ...}} (a reason only where "auto" chose)."""
        reasons = dict(self.reasons)
        out = {}
        for field in dataclasses.fields(self):
            if field.name in ("reasons", "gguf_blocks_required"):
                continue
            entry = {"value": getattr(self, field.name)}
            if field.name in reasons:
                entry["reason"] = reasons[field.name]
            out[field.name] = entry
        return out


@dataclasses.dataclass(frozen=True)
class Resolution:
    options: ResolvedOptions
    kernels: ModelKernels  # the callables the model runs (static under jit)


def _common_reasons(platform: Platform, tp: int, dtype: str) -> list[str]:
    """Why no C++ kernel can run with these settings (empty when they can)."""
    reasons = []
    if platform.backend != "cpu":
        reasons.append(f"it runs on XLA:CPU, not {platform.backend}")
    if tp != 1:
        reasons.append("it runs on one device (tensor_parallel_size=1)")
    if dtype != "float32":
        reasons.append(f"it takes float32 activations, not {dtype}")
    unavailable = platform.native_unavailable()
    if unavailable is not None:
        reasons.append(unavailable)
    return reasons


def _warmup(
    options: EngineOptions, platform: Platform, layer_execution: str, reasons: dict[str, str]
) -> str:
    """options.warmup settled: "background" where the runner can compile a bucket's programs
    without running them and every process picks the same buckets; a ValueError where it was
    asked for and cannot."""
    why = []
    if platform.num_processes > 1:
        why.append("several processes step in lockstep (each would pick buckets by its own pace)")
    if layer_execution != "scan":
        why.append("per-layer execution compiles a bucket's programs by running them")
    if options.speculative_method == "draft":
        why.append("a draft model's programs are compiled with the target's")
    if options.warmup == "background" and why:
        raise ValueError("warmup 'background' cannot be used here: " + "; ".join(why))
    if options.warmup != "auto":
        return options.warmup
    reasons["warmup"] = "; ".join(why) if why else "one process, layers under a scan"
    return "all" if why else "background"


def _native(platform: Platform, name: str, option: str, value: str, reasons: list[str]):
    """(the C++ kernel `name`, why not): where `value` was asked for explicitly ("cpu"/"on"),
    a reason is a ValueError and a failed build a KernelBuildError."""
    required = value != "auto"
    if reasons:
        if required:
            raise ValueError(f"{option} {value!r} cannot be used here: " + "; ".join(reasons))
        return None, "; ".join(reasons)
    try:
        return platform.load_native(name), ""
    except KernelBuildError as error:
        if required:
            raise
        logger.warning("C++ kernel for %s unavailable (%s); going without it", option, error)
        return None, f"its build failed ({error})"


# Implementations known to reduce in an order fixed per token (batch_invariant), by kind.
INVARIANT_KERNELS = {
    "attention": ("auto", "cpu", "pallas_interpret"),
    "ffn": ("auto", "reference"),
    "norm": ("auto", "invariant", "pallas", "pallas_interpret"),
    "grouped_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
    "int4_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
}


def _check_invariant_request(options: EngineOptions, cpu: bool) -> None:
    """Clear errors for batch_invariant with a choice that cannot honour it."""
    if not cpu:
        raise ValueError(
            "batch_invariant runs on CPU only for now: on a GPU the projections go through "
            "XLA's dot (cuBLAS), whose reduction order follows the number of rows"
        )
    for kind, allowed in INVARIANT_KERNELS.items():
        name = getattr(options, f"{kind}_impl")
        if name not in allowed:
            raise ValueError(
                f"batch_invariant: {kind}_impl {name!r} is not known to reduce in a fixed "
                f"order per token; use one of {list(allowed)}"
            )
    fixed = {
        "matmul_impl": ("auto", "cpu"),
        "weight_layout": ("auto", "out_in"),
        "gguf_weights": ("auto", "off"),
    }
    for name, allowed in fixed.items():
        if getattr(options, name) not in allowed:
            raise ValueError(
                f"batch_invariant needs {name} in {list(allowed)}, got {getattr(options, name)!r}"
                " (the C++ matmul kernel in its fixed order computes every projection)"
            )


def resolve(
    options: EngineOptions,
    platform: Platform,
    arch: LlamaConfig,
    registry: KernelRegistry,
    gguf_source: Path | None = None,
    probe: Callable[..., str | None] = probe_kernel,
) -> Resolution:
    """Settles every "auto" of `options` for `platform` and a model of shape `arch`.
    gguf_source: the GGUF file the model folder was converted from, if it keeps one.
    probe(kind, kernel, arch, dtype, block_size, kv_format): why a Pallas kernel cannot run on this GPU
    at the model's shapes, or None (jaxinfer.layers.kernel_probe); "auto" then takes the
    reference, an explicit "pallas" is an error."""
    reasons: dict[str, str] = {}
    tp = options.tensor_parallel_size
    cpu = platform.backend == "cpu"
    invariant = options.batch_invariant
    if invariant:
        _check_invariant_request(options, cpu)

    dtype = options.dtype
    if dtype == "auto":
        dtype = "float32" if cpu else "bfloat16"
        reasons["dtype"] = f"float32 on CPU, bfloat16 on accelerators ({platform.backend})"

    def pick(kind: str, name: str) -> str:
        asked = name
        if name == "auto" and invariant and kind == "norm" and cpu:
            reasons[kind] = "batch_invariant: the reference with one row per reduction"
            return "invariant"
        if name == "auto":
            single_gpu = platform.backend == "gpu" and tp == 1
            name = "pallas" if single_gpu else "reference"
            reasons[kind] = (
                "the Pallas kernels on one GPU"
                if single_gpu
                else f"the reference off a single GPU ({platform.backend}, tp={tp})"
            )
        if name == "pallas" and tp > 1:
            raise ValueError(
                f"{kind} kernel 'pallas' does not run under tensor parallelism yet "
                f"(tensor_parallel_size={tp}): use 'reference' or 'auto'"
            )
        kernel = registry.get(kind, name)  # a clear error for unknown names
        if name == "pallas" and platform.backend == "gpu":
            kv_format = KVCacheFormat.resolve(options.kv_cache_dtype, dtype)
            why_not = probe(kind, kernel, arch, dtype, options.block_size, kv_format)
            if why_not is not None:
                if asked != "auto":
                    raise ValueError(f"{kind}_impl 'pallas' cannot run here: {why_not}")
                logger.warning("the Pallas %s kernel is not used: %s", kind, why_not)
                reasons[kind] = f"the reference: the Pallas kernel was probed and {why_not}"
                return "reference"
        return name

    ffn = pick("ffn", options.ffn_impl)
    norm = pick("norm", options.norm_impl)
    if arch.moe is not None:
        grouped = pick("grouped_matmul", options.grouped_matmul_impl)
    else:  # no experts to run: nothing to choose or probe
        grouped = (
            "reference" if options.grouped_matmul_impl == "auto" else options.grouped_matmul_impl
        )
        registry.get("grouped_matmul", grouped)  # (a clear error for an unknown name)
    if options.quantization == "int8" and arch.quantization is not None:
        raise ValueError(
            f"quantization 'int8': the checkpoint is saved as {arch.quantization}; leave "
            "quantization unset (or int4, which quantizes the float weights left, the LM head)"
        )
    int4 = options.quantization == "int4" or arch.quantization is not None
    if int4:
        int4_kernel = pick("int4_matmul", options.int4_matmul_impl)
    else:  # no int4 weights: nothing to choose or probe
        int4_kernel = (
            "reference" if options.int4_matmul_impl == "auto" else options.int4_matmul_impl
        )
        registry.get("int4_matmul", int4_kernel)  # (a clear error for an unknown name)
    weight_format = "dense"
    if arch.quantization is not None:
        weight_format = str(arch.quantization)
    elif options.quantization is not None:
        weight_format = str(quantization_of(options))
    reference_ffn = registry.get("ffn", ffn) is fused_ffn_reference
    layout = options.weight_layout
    if layout == "auto" and invariant:
        layout = OUT_IN
        reasons["weight_layout"] = "batch_invariant: the matmul kernel's layout"
    if layout == "auto":
        layout = OUT_IN if cpu and reference_ffn else IN_OUT
        reasons["weight_layout"] = (
            "W @ x^T runs faster on XLA:CPU with the reference FFN"
            if layout == OUT_IN
            else "the layout of the checkpoint and the FFN kernels"
        )
    if layout == OUT_IN and not reference_ffn:
        raise ValueError(
            f"weight_layout 'out_in' runs the reference FFN; ffn_impl {options.ffn_impl!r} takes "
            "'in_out' weights: use weight_layout 'in_out' or 'auto'"
        )

    if layout == OUT_IN and options.grouped_matmul_impl not in ("auto", "reference"):
        raise ValueError(
            f"weight_layout 'out_in' runs the experts through the C++ grouped kernel or the "
            f"reference; grouped_matmul_impl {options.grouped_matmul_impl!r} takes 'in_out' "
            "weights: use weight_layout 'in_out' or 'auto'"
        )

    # the matmul kernel
    matmul_fn = None
    if options.matmul_impl != "xla":
        why = _common_reasons(platform, tp, dtype)
        if layout != OUT_IN:
            why.append("it takes the 'out_in' weight layout")
        asked = "cpu" if invariant else options.matmul_impl  # invariant: required
        matmul_fn, why_not = _native(platform, "matmul", "matmul_impl", asked, why)
        if options.matmul_impl == "auto":
            reasons["matmul"] = "the C++ kernel runs here" if matmul_fn else why_not
            if invariant:
                reasons["matmul"] += " (batch_invariant: its fixed order for every row count)"
    matmul = "cpu" if matmul_fn is not None else "xla"
    if matmul_fn is not None and int4:
        int4_kernel = "cpu"
        reasons["int4_matmul"] = "the C++ matmul kernel's int4 product"
    if options.int8_activations and (not int4 or matmul_fn is None):
        raise ValueError(
            "int8_activations applies to int4 weights in the C++ matmul kernel: "
            + ("there are no int4 weights" if not int4 else "the kernel is not in use")
        )
    if matmul_fn is not None:  # the C++ library's grouped product, "out_in"
        grouped = "cpu"
        if options.grouped_matmul_impl == "auto" and arch.moe is not None:
            reasons["grouped_matmul"] = "the C++ matmul kernel's grouped product"
    elif layout == OUT_IN:
        grouped = "reference"

    # attention: the C++ kernel for "cpu", and for "auto" where it runs
    attention_fn, why_not = None, ""
    if options.attention_impl in ("auto", "cpu"):
        why = _common_reasons(platform, tp, dtype)
        if arch.head_dim % 8 or arch.head_dim > 256:
            why.append(
                f"it takes a head_dim that is a multiple of 8 up to 256, not {arch.head_dim}"
            )
        if options.block_size > 128:
            why.append(f"it takes a block_size up to 128, not {options.block_size}")
        asked = "cpu" if invariant else options.attention_impl  # invariant on CPU: required
        attention_fn, why_not = _native(platform, "paged_attention", "attention_impl", asked, why)
    if attention_fn is not None:
        attention = "cpu"
        if options.attention_impl == "auto":
            reasons["attention"] = "the C++ kernel runs here"
    else:
        attention = pick("attention", options.attention_impl)
        if why_not:
            reasons["attention"] += f"; not the C++ kernel: {why_not}"

    # GGUF blocks beside the matmul kernel
    gguf_fn = None
    if invariant and options.gguf_weights == "auto":
        reasons["gguf_blocks"] = "off under batch_invariant: the block kernel's order is its own"
    elif options.gguf_weights != "off":
        why = []
        if matmul_fn is None:
            why.append("they work beside the matmul kernel, which is not in use (matmul_impl)")
        if options.quantization is not None:
            why.append(f"they take float32 weights, not {options.quantization}")
        if gguf_source is None:
            why.append("the model was not converted from a GGUF file (or its folder lost it)")
        gguf_fn, why_not = _native(
            platform, "gguf_matmul", "gguf_weights", options.gguf_weights, why
        )
        if options.gguf_weights == "auto":
            reasons["gguf_blocks"] = (
                f"{gguf_source.name} may hold exact blocks" if gguf_fn else why_not
            )

    layer_execution = options.layer_execution
    if layer_execution == "auto":
        if matmul_fn is not None:
            layer_execution = "scan"
            reasons["layer_execution"] = "the matmul kernel reads each layer's weights in place"
        elif cpu:
            layer_execution = "per_layer"
            reasons["layer_execution"] = "on XLA:CPU the scan's weight slices are copies"
        else:
            layer_execution = "scan"
            reasons["layer_execution"] = "one program per step"
    async_scheduling = options.async_scheduling
    if async_scheduling is None:
        async_scheduling = not cpu
        reasons["async_scheduling"] = (
            "off on CPU, where the device is the host's own cores" if cpu else "on accelerators"
        )
    free_tokens = options.speculative_free_tokens
    if free_tokens is None:
        free_tokens = 8 if cpu else 64
        reasons["speculative_free_tokens"] = (
            "on CPU a step of more than a few tokens is bound by compute"
            if cpu
            else "an accelerator reads the weights longer than it computes in small steps "
            "(an estimate, not measured)"
        )
    warmup = _warmup(options, platform, layer_execution, reasons)
    cache_dir = None
    if options.compilation_cache:
        cache_dir = options.compilation_cache_dir or str(Path(options.cache_dir) / "xla")

    resolved = ResolvedOptions(
        dtype=dtype,
        attention=attention,
        ffn=ffn,
        norm=norm,
        grouped_matmul=grouped,
        weight_layout=layout,
        weight_format=weight_format,
        int4_matmul=int4_kernel,
        matmul=matmul,
        gguf_blocks=gguf_fn is not None,
        gguf_blocks_required=options.gguf_weights == "on",
        layer_execution=layer_execution,
        async_scheduling=async_scheduling,
        batch_invariant=invariant,
        speculative_free_tokens=free_tokens,
        warmup=warmup,
        compilation_cache_dir=cache_dir,
        reasons=tuple(sorted(reasons.items())),
    )
    if attention_fn is None:
        attention_fn = registry.get("attention", attention)
        if invariant:  # a Pallas kernel (INVARIANT_KERNELS): one BQ, no kv splits
            attention_fn = functools.partial(attention_fn, batch_invariant=True)
    kernels = ModelKernels(
        attention=attention_fn,
        ffn=registry.get("ffn", ffn),
        add_rms_norm=registry.get("norm", norm),
        grouped_matmul=registry.get("grouped_matmul", "reference" if grouped == "cpu" else grouped),
        weight_layout=layout,
        int4_matmul=registry.get(
            "int4_matmul", "reference" if int4_kernel == "cpu" else int4_kernel
        ),
        matmul=None
        if matmul_fn is None
        else KernelMatmul(
            matmul_fn,
            gguf_kernel=gguf_fn,
            fixed_order=invariant,
            int8_activations=options.int8_activations,
        ),
        batch_invariant=invariant,
    )
    return Resolution(resolved, kernels)

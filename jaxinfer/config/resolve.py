"""The one place where "auto" is settled: EngineOptions and the Platform (plus the model's shape
and the kernel registry) in, a frozen ResolvedOptions and the ModelKernels out. Every choice
made from "auto" records why (`ResolvedOptions.describe()`, logged at start-up and returned at
GET /v1/engine); nothing downstream decides again. On a GPU each Pallas kernel chosen is first
probed on the model's shapes (jaxinfer.layers.kernel_probe): "auto" falls back to the
reference where one fails, an explicit "pallas" that fails is an error.

The C++ kernels for XLA:CPU (cpu_kernels) need XLA:CPU, float32 activations and one device
(XLA cannot split a custom call over a mesh), and a C++ compiler to build them once:
- matmul "cpu": the "out_in" projections and LM head, token-major (no transposes), int8 read
  as int8; float32 products of prefill-sized chunks stay on XLA's GEMM
  (jaxinfer.layers.native_kernels.KernelMatmul).
- attention "cpu": ragged paged attention walking each request's blocks with an online
  softmax (head_dim a multiple of 8 up to 256, block_size up to 128).
- GGUF blocks: the weights of a GGUF file read in place, in its own block formats
  (cpu_kernels/gguf_matmul), with float or int8 activations.

batch_invariant (CPU): every product through the C++ matmul kernel in its fixed order, no XLA
GEMM or GGUF blocks; attention through the C++ kernel; norms through the "invariant" reference
and the sampler's sums as fixed trees (jaxinfer.config.invariant has the rules). On a GPU: the
projections through the Pallas matmul kernel (jaxinfer.layers.pallas_matmul), the Pallas
attention and norm kernels in their invariant forms, float weights only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config import native, speculative
from jaxinfer.config.compressed import check_compressed
from jaxinfer.config.compressed import prefix_caching as compressed_prefix_caching
from jaxinfer.config.hybrid import check_hybrid, prefix_caching
from jaxinfer.config.invariant import check_invariant_request
from jaxinfer.config.layer_kernels import layer_kernels
from jaxinfer.config.lora import lora_kernel
from jaxinfer.config.native import native_kernel, native_reasons
from jaxinfer.config.options import EngineOptions, quantization_of
from jaxinfer.config.platform import Platform
from jaxinfer.config.resolved import Resolution, ResolvedOptions
from jaxinfer.config.warmup import warmup
from jaxinfer.layers.kernel_probe import probe_kernel
from jaxinfer.layers.kernel_registry import KernelRegistry, ModelKernels
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.layers.linear import IN_OUT, OUT_IN
from jaxinfer.layers.native_kernels import KernelMatmul
from jaxinfer.layers.pallas_matmul import PallasMatmul
from pallas_kernels.fused_ffn.reference import fused_ffn_reference

logger = logging.getLogger(__name__)

PALLAS_MATMULS = ("pallas", "pallas_interpret")


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
    probe(kind, kernel, arch, dtype, block_size, kv_format): why a Pallas kernel cannot run on
    this GPU at the model's shapes, or None (jaxinfer.layers.kernel_probe); "auto" then takes
    the reference, an explicit "pallas" is an error."""
    check_hybrid(options, arch)
    check_compressed(options, arch)
    r = _Resolver(options, platform, arch, registry, gguf_source, probe)
    ffn = r.pick("ffn", options.ffn_impl)
    norm = r.pick("norm", options.norm_impl)
    grouped = r.pick_if_used("grouped_matmul", options.grouped_matmul_impl, arch.moe is not None)
    r.check_quantization()
    int4 = options.quantization == "int4" or arch.quantization is not None
    int4_kernel = r.pick_if_used("int4_matmul", options.int4_matmul_impl, int4)
    layout = r.weight_layout(ffn)
    pallas_matmul = r.pallas_matmul(layout)
    matmul_fn = None if pallas_matmul is not None else r.matmul_kernel(layout)
    if matmul_fn is not None and int4:
        int4_kernel = "cpu"
        r.reasons["int4_matmul"] = "the C++ matmul kernel's int4 product"
    if matmul_fn is not None:  # the C++ library's grouped product, "out_in"
        grouped = "cpu"
        if options.grouped_matmul_impl == "auto" and arch.moe is not None:
            r.reasons["grouped_matmul"] = "the C++ matmul kernel's grouped product"
    elif layout == OUT_IN:
        grouped = "reference"
    attention, attention_fn = r.attention()
    gguf_fn = r.gguf_kernel(matmul_fn)
    native.check_int8_activations(options, matmul_fn, gguf_fn, int4)
    layer_execution = r.layer_execution(matmul_fn)
    lora, lora_fn = lora_kernel(options, platform, arch, r.dtype, registry, r.reasons)
    own, own_fns = layer_kernels(options, platform, arch, r.dtype, registry, r.reasons)
    resolved = ResolvedOptions(
        dtype=r.dtype,
        attention=attention,
        ffn=ffn,
        norm=norm,
        grouped_matmul=grouped,
        weight_layout=layout,
        weight_format=r.weight_format(),
        int4_matmul=int4_kernel,
        matmul="cpu" if matmul_fn is not None else getattr(pallas_matmul, "name", "xla"),
        gguf_blocks=gguf_fn is not None,
        gguf_interleaved=native.gguf_interleaved(options, gguf_fn),
        gguf_blocks_required=options.gguf_weights == "on",
        layer_execution=layer_execution,
        async_scheduling=r.async_scheduling(),
        batch_invariant=r.invariant,
        speculative_free_tokens=speculative.free_tokens(options, r.cpu, r.reasons),
        speculative_adaptive=speculative.adaptive(options, platform, r.reasons),
        warmup=warmup(options, platform, layer_execution, r.reasons),
        compilation_cache_dir=r.compilation_cache_dir(),
        lora=lora,
        **own,
        prefix_caching=prefix_caching(options, arch, r.reasons)
        and compressed_prefix_caching(options, arch, r.reasons),
        reasons=tuple(sorted(r.reasons.items())),
    )
    kernels = r.kernels(resolved, attention_fn, matmul_fn, gguf_fn, pallas_matmul)
    if lora_fn is not None:
        kernels = replace(kernels, lora=lora_fn)
    kernels = replace(kernels, **own_fns)
    return Resolution(resolved, kernels)


class _Resolver:
    """resolve()'s choices, one method per concern, sharing the options, the platform and the
    reasons recorded so far."""

    def __init__(self, options, platform, arch, registry, gguf_source, probe):
        self.options, self.platform, self.arch = options, platform, arch
        self.registry, self.gguf_source, self.probe = registry, gguf_source, probe
        self.reasons: dict[str, str] = {}
        self.tp = options.tensor_parallel_size
        self.cpu = platform.backend == "cpu"
        self.invariant = options.batch_invariant
        if self.invariant:
            check_invariant_request(options, self.cpu)
        self.dtype = options.dtype
        if self.dtype == "auto":
            self.dtype = "float32" if self.cpu else "bfloat16"
            self.reasons["dtype"] = f"float32 on CPU, bfloat16 on accelerators ({platform.backend})"

    def pick(self, kind: str, name: str) -> str:
        """A registry kernel of `kind`: "auto" settled; on a GPU a Pallas one probed."""
        asked, tp, reasons = name, self.tp, self.reasons
        if name == "auto" and self.invariant and kind == "norm" and self.cpu:
            reasons[kind] = "batch_invariant: the reference with one row per reduction"
            return "invariant"
        if name == "auto" and self.invariant and kind in ("ffn", "grouped_matmul", "int4_matmul"):
            reasons[kind] = "batch_invariant: the reference, its products through the matmul kernel"
            return "reference"
        if name == "auto":
            single_gpu = self.platform.backend == "gpu" and tp == 1
            name = "pallas" if single_gpu else "reference"
            reasons[kind] = (
                "the Pallas kernels on one GPU"
                if single_gpu
                else f"the reference off a single GPU ({self.platform.backend}, tp={tp})"
            )
        if name == "pallas" and tp > 1:
            raise ValueError(
                f"{kind} kernel 'pallas' does not run under tensor parallelism yet "
                f"(tensor_parallel_size={tp}): use 'reference' or 'auto'"
            )
        kernel = self.registry.get(kind, name)  # a clear error for unknown names
        if name == "pallas" and self.platform.backend == "gpu":
            kv_format = KVCacheFormat.resolve(self.options.kv_cache_dtype, self.dtype)
            why_not = self.probe(
                kind, kernel, self.arch, self.dtype, self.options.block_size, kv_format
            )
            if why_not is not None:
                if asked != "auto":
                    raise ValueError(f"{kind}_impl 'pallas' cannot run here: {why_not}")
                logger.warning("the Pallas %s kernel is not used: %s", kind, why_not)
                reasons[kind] = f"the reference: the Pallas kernel was probed and {why_not}"
                return "reference"
        return name

    def pick_if_used(self, kind: str, name: str, used: bool) -> str:
        """pick() where the model has such products; else nothing to choose or probe ("auto"
        is the reference), but an unknown name is still a clear error."""
        if used:
            return self.pick(kind, name)
        name = "reference" if name == "auto" else name
        self.registry.get(kind, name)
        return name

    def check_quantization(self) -> None:
        if self.options.quantization == "int8" and self.arch.quantization is not None:
            raise ValueError(
                f"quantization 'int8': the checkpoint is saved as {self.arch.quantization}; "
                "leave quantization unset (or int4, which quantizes the float weights left, "
                "the LM head)"
            )

    def weight_format(self) -> str:
        if self.arch.quantization is not None:
            return str(self.arch.quantization)
        if self.options.quantization is not None:
            return str(quantization_of(self.options))
        return "dense"

    def weight_layout(self, ffn: str) -> str:
        options, reasons = self.options, self.reasons
        reference_ffn = self.registry.get("ffn", ffn) is fused_ffn_reference
        layout = options.weight_layout
        if layout == "auto" and self.arch.compressed is not None:
            layout = IN_OUT
            reasons["weight_layout"] = "DeepSeek-V4's layers take the checkpoint's layout"
        if layout == "auto" and (self.invariant or self.options.matmul_impl in PALLAS_MATMULS):
            layout = OUT_IN
            reasons["weight_layout"] = "the matmul kernel's layout" + (
                " (batch_invariant)" if self.invariant else ""
            )
        if layout == "auto":
            layout = OUT_IN if self.cpu and reference_ffn else IN_OUT
            reasons["weight_layout"] = (
                "W @ x^T runs faster on XLA:CPU with the reference FFN"
                if layout == OUT_IN
                else "the layout of the checkpoint and the FFN kernels"
            )
        if layout == OUT_IN and not reference_ffn:
            raise ValueError(
                f"weight_layout 'out_in' runs the reference FFN; ffn_impl {options.ffn_impl!r} "
                "takes 'in_out' weights: use weight_layout 'in_out' or 'auto'"
            )
        if layout == OUT_IN and options.grouped_matmul_impl not in ("auto", "reference"):
            raise ValueError(
                f"weight_layout 'out_in' runs the experts through the C++ grouped kernel or the "
                f"reference; grouped_matmul_impl {options.grouped_matmul_impl!r} takes 'in_out' "
                "weights: use weight_layout 'in_out' or 'auto'"
            )
        return layout

    def pallas_matmul(self, layout: str) -> PallasMatmul | None:
        """The Pallas matmul kernel for the "out_in" products, where asked for or where
        batch_invariant runs on a GPU; else None."""
        options, arch, name = self.options, self.arch, self.options.matmul_impl
        if name == "auto" and self.invariant and not self.cpu:
            name = "pallas"
            self.reasons["matmul"] = "batch_invariant on a GPU: tiles fixed for every row count"
        if name not in PALLAS_MATMULS:
            return None
        why = []
        if layout != OUT_IN:
            why.append(f"it takes the 'out_in' weight layout, not {layout!r}")
        if options.quantization is not None or arch.quantization is not None:
            why.append("it takes float weights (the model's are quantized)")
        if arch.moe is not None:
            why.append("a MoE model's experts have no grouped product beside it")
        if self.tp != 1:
            why.append("it runs on one device (tensor_parallel_size=1)")
        if name == "pallas" and self.cpu:
            why.append("it compiles for a GPU (pallas_interpret runs it on CPU)")
        if why:
            raise ValueError(f"matmul_impl {name!r} cannot be used here: " + "; ".join(why))
        return PallasMatmul(interpret=name == "pallas_interpret")

    def matmul_kernel(self, layout: str):
        """The C++ matmul kernel, or None (XLA's dot)."""
        options = self.options
        if options.matmul_impl == "xla":
            return None
        why = native_reasons(self.platform, self.tp, self.dtype)
        if layout != OUT_IN:
            why.append("it takes the 'out_in' weight layout")
        asked = "cpu" if self.invariant else options.matmul_impl  # invariant: required
        matmul_fn, why_not = native_kernel(self.platform, "matmul", "matmul_impl", asked, why)
        if options.matmul_impl == "auto":
            self.reasons["matmul"] = "the C++ kernel runs here" if matmul_fn else why_not
            if self.invariant:
                self.reasons["matmul"] += " (batch_invariant: its fixed order for every row count)"
        return matmul_fn

    def attention(self):
        """(name, the C++ kernel or None): the C++ kernel for "cpu", and for "auto" where it
        runs; else a registry kernel."""
        options, arch = self.options, self.arch
        attention_fn, why_not = None, ""
        if options.attention_impl in ("auto", "cpu"):
            why = native_reasons(self.platform, self.tp, self.dtype)
            if arch.head_dim % 8 or arch.head_dim > 256:
                why.append(
                    f"it takes a head_dim that is a multiple of 8 up to 256, not {arch.head_dim}"
                )
            if options.block_size > 128:
                why.append(f"it takes a block_size up to 128, not {options.block_size}")
            # invariant on CPU: the C++ kernel is required
            asked = "cpu" if self.invariant and self.cpu else options.attention_impl
            attention_fn, why_not = native_kernel(
                self.platform, "paged_attention", "attention_impl", asked, why
            )
        if attention_fn is not None:
            if options.attention_impl == "auto":
                self.reasons["attention"] = "the C++ kernel runs here"
            return "cpu", attention_fn
        attention = self.pick("attention", options.attention_impl)
        if why_not:
            self.reasons["attention"] += f"; not the C++ kernel: {why_not}"
        return attention, None

    def gguf_kernel(self, matmul_fn):
        """The C++ GGUF block kernel beside the matmul kernel, or None."""
        options = self.options
        if self.invariant and options.gguf_weights == "auto":
            self.reasons["gguf_blocks"] = (
                "off under batch_invariant: the block kernel's order depends on the rows"
            )
            return None
        if options.gguf_weights == "off":
            return None
        why = []
        if matmul_fn is None:
            why.append("they work beside the matmul kernel, which is not in use (matmul_impl)")
        if options.quantization is not None:
            why.append(f"the weights are to be quantized ({options.quantization})")
        if self.dtype != "float32":
            why.append(f"the block kernel takes float32 activations, not {self.dtype}")
        if self.gguf_source is None:
            why.append("the model was not converted from a GGUF file (or its folder lost it)")
        gguf_fn, why_not = native_kernel(
            self.platform, "gguf_matmul", "gguf_weights", options.gguf_weights, why
        )
        if options.gguf_weights == "auto":
            self.reasons["gguf_blocks"] = (
                f"{self.gguf_source.name}'s projections read in place" if gguf_fn else why_not
            )
        return gguf_fn

    def layer_execution(self, matmul_fn) -> str:
        if self.options.layer_execution != "auto":
            return self.options.layer_execution
        if self.arch.hybrid is not None or self.arch.compressed is not None:
            execution, why = "scan", "the model's own layers (hybrid, DeepSeek-V4) in one program"
        elif matmul_fn is not None:
            execution, why = "scan", "the matmul kernel reads each layer's weights in place"
        elif self.cpu:
            execution, why = "per_layer", "on XLA:CPU the scan's weight slices are copies"
        else:
            execution, why = "scan", "one program per step"
        self.reasons["layer_execution"] = why
        return execution

    def async_scheduling(self) -> bool:
        if self.options.async_scheduling is not None:
            return self.options.async_scheduling
        self.reasons["async_scheduling"] = (
            "off on CPU, where the device is the host's own cores"
            if self.cpu
            else "on accelerators"
        )
        return not self.cpu

    def compilation_cache_dir(self) -> str | None:
        if not self.options.compilation_cache:
            return None
        return self.options.compilation_cache_dir or str(Path(self.options.cache_dir) / "xla")

    def kernels(
        self, resolved: ResolvedOptions, attention_fn, matmul_fn, gguf_fn, pallas_matmul
    ) -> ModelKernels:
        """The callables the model runs, for the choices in `resolved`."""
        registry, invariant = self.registry, self.invariant
        if attention_fn is None:
            attention_fn = registry.get("attention", resolved.attention)
            if invariant:  # a Pallas kernel (INVARIANT_KERNELS): one BQ, no kv splits
                attention_fn = functools.partial(attention_fn, batch_invariant=True)
        grouped, int4_kernel = resolved.grouped_matmul, resolved.int4_matmul
        return ModelKernels(
            attention=attention_fn,
            ffn=registry.get("ffn", resolved.ffn),
            add_rms_norm=registry.get("norm", resolved.norm),
            grouped_matmul=registry.get(
                "grouped_matmul", "reference" if grouped == "cpu" else grouped
            ),
            weight_layout=resolved.weight_layout,
            int4_matmul=registry.get(
                "int4_matmul", "reference" if int4_kernel == "cpu" else int4_kernel
            ),
            matmul=pallas_matmul
            if matmul_fn is None
            else KernelMatmul(
                matmul_fn,
                gguf_kernel=gguf_fn,
                fixed_order=invariant,
                int8_activations=self.options.int8_activations,
            ),
            batch_invariant=invariant,
        )

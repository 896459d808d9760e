"""batch_invariant's rules: the kernels known to reduce in an order fixed per token, and the
clear errors for a choice that cannot honour the mode (jaxinfer.config.resolve applies them)."""

from __future__ import annotations

from jaxinfer.config.options import EngineOptions

# Implementations known to reduce in an order fixed per token (batch_invariant), by kind.
INVARIANT_KERNELS = {
    "attention": ("auto", "cpu", "pallas", "pallas_interpret"),
    "ffn": ("auto", "reference"),
    "norm": ("auto", "invariant", "pallas", "pallas_interpret"),
    "grouped_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
    "int4_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
}


def check_invariant_request(options: EngineOptions, cpu: bool) -> None:
    """Clear errors for batch_invariant with a choice that cannot honour it."""
    for kind, allowed in INVARIANT_KERNELS.items():
        name = getattr(options, f"{kind}_impl")
        if name not in allowed:
            raise ValueError(
                f"batch_invariant: {kind}_impl {name!r} is not known to reduce in a fixed "
                f"order per token; use one of {list(allowed)}"
            )
    # Every projection through a matmul kernel in its fixed order: the C++ one on CPU, the
    # Pallas one on a GPU (XLA's dot, cuBLAS, tiles by the whole shape, rows included).
    matmuls = ("auto", "cpu", "pallas_interpret") if cpu else ("auto", "pallas")
    fixed = {
        "matmul_impl": matmuls,
        "weight_layout": ("auto", "out_in"),
        "gguf_weights": ("auto", "off"),
    }
    for name, allowed in fixed.items():
        if getattr(options, name) not in allowed:
            raise ValueError(
                f"batch_invariant needs {name} in {list(allowed)}, got {getattr(options, name)!r}"
                " (a matmul kernel in its fixed order computes every projection)"
            )
    if not cpu and options.quantization is not None:
        raise ValueError(
            f"batch_invariant on a GPU takes float weights (the Pallas matmul kernel), not "
            f"quantization {options.quantization!r}"
        )

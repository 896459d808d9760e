"""batch_invariant's rules: the kernels known to reduce in an order fixed per token, and the
clear errors for a choice that cannot honour the mode (jaxinfer.config.resolve applies them)."""

from __future__ import annotations

from jaxinfer.config.options import EngineOptions

# Implementations known to reduce in an order fixed per token (batch_invariant), by kind.
INVARIANT_KERNELS = {
    "attention": ("auto", "cpu", "pallas_interpret"),
    "ffn": ("auto", "reference"),
    "norm": ("auto", "invariant", "pallas", "pallas_interpret"),
    "grouped_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
    "int4_matmul": ("auto", "reference"),  # unused: "out_in" takes the C++ kernel's
}


def check_invariant_request(options: EngineOptions, cpu: bool) -> None:
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

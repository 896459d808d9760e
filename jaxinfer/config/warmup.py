"""EngineOptions.warmup settled (for jaxinfer.config.resolve)."""

from __future__ import annotations

from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform


def warmup(
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
    if options.speculative_method == "mtp":
        why.append("the MTP layer's programs are compiled with the model's")
    if options.warmup == "background" and why:
        raise ValueError("warmup 'background' cannot be used here: " + "; ".join(why))
    if options.warmup != "auto":
        return options.warmup
    reasons["warmup"] = "; ".join(why) if why else "one process, layers under a scan"
    return "all" if why else "background"

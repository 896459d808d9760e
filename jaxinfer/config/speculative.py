"""Speculative decoding's "auto" options settled (for jaxinfer.config.resolve)."""

from __future__ import annotations

from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform


def free_tokens(options: EngineOptions, cpu: bool, reasons: dict[str, str]) -> int:
    """Steps up to this many tokens cost about as much as a one-token step (the rule of
    thumb where step times are not measured yet, SchedulerConfig.spec_free_tokens)."""
    if options.speculative_free_tokens is not None:
        return options.speculative_free_tokens
    reasons["speculative_free_tokens"] = (
        "on CPU a step of more than a few tokens is bound by compute"
        if cpu
        else "an accelerator reads the weights longer than it computes in small steps "
        "(an estimate, not measured)"
    )
    return 8 if cpu else 64


def adaptive(options: EngineOptions, platform: Platform, reasons: dict[str, str]) -> bool:
    """Proposals planned by measured step times (jaxinfer.engine.speculation.control): each
    process would measure its own, so processes in lockstep (which must schedule alike) keep
    the rule of thumb."""
    lockstep = platform.num_processes > 1
    if options.speculative_adaptive is not None:
        if options.speculative_adaptive and lockstep:
            raise ValueError(
                "speculative_adaptive cannot be used with several processes: each would plan "
                "by its own step times"
            )
        return options.speculative_adaptive
    if options.speculative_method != "none":
        reasons["speculative_adaptive"] = (
            "several processes must schedule alike (the rule of thumb)"
            if lockstep
            else "proposals planned by measured step times"
        )
    return not lockstep

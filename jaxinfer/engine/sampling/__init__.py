"""Sampling on the device: the sampler, its logits processors (penalties, top-k/top-p/min-p,
bias) and the structured-output constraints (grammar bitmasks)."""

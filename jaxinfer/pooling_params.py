"""How a request's prompt becomes one embedding (the engine's pooling path, /v1/embeddings)."""

from __future__ import annotations

import dataclasses

from jaxinfer.sampling_params import RequestOutputKind, SamplingParams

POOLINGS = ("last", "mean", "cls")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """Args:
    pooling: the final-norm hidden states of the prompt's tokens pooled as the last token's
        (decoder models' usual), their mean, or the first token's (CLS).
    normalize: scaled to unit length.
    dimensions: the first this many values kept (before normalizing; Matryoshka models), or
        all of them.
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")

    def sampling_params(self) -> SamplingParams:
        """How an embedding request samples: one greedy token, never reported (the step that
        computes the prompt's last token samples it, and the request ends there)."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
        )


def check_dimensions(pooling: PoolingParams, hidden_size: int) -> None:
    """A ValueError where `dimensions` asks for more values than the model's embeddings have."""
    if pooling.dimensions is not None and pooling.dimensions > hidden_size:
        raise ValueError(
            f"dimensions {pooling.dimensions} exceeds the model's embedding size ({hidden_size})"
        )

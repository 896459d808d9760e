"""What every proposer asks first: which running requests propose this step (caught up to
their last token) and how many proposals max_tokens and max_model_len leave each; and what a
model proposer's (a draft model's, the MTP layer's) run did, for the step-time plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxinfer.engine.scheduling.request import Request


def proposal_candidates(
    running: list[Request], max_model_len: int
) -> Iterator[tuple[Request, int]]:
    """(request, room) for each running request that proposes and is caught up to its last
    token; room: the proposals max_tokens and max_model_len leave it."""
    for request in running:
        if (
            request.spec is None
            or request.num_output_placeholders
            or request.num_tokens - request.num_computed_tokens != 1
        ):
            continue
        room = max_model_len - 1 - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        yield request, room


@dataclasses.dataclass(frozen=True)
class DraftRun:
    """What one step's proposing with the draft model or MTP layer did."""

    rows: int = 0  # requests it ran for
    steps: int = 0  # its one-token steps (the MTP layer's run over the step not counted)
    proposing: int = 0  # requests that propose in the next step
    left: int = 0  # requests that left it (draft_off) in this step

"""Each step's proposals: which running requests propose (caught up to their last token, with
room left), and what they propose, by n-grams or by the draft model."""

from __future__ import annotations

from collections.abc import Iterator

from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.execution.row_table import RowTable
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.engine.speculation.draft_model import DraftModel
from jaxinfer.engine.speculation.ngram import NgramProposer


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


def propose_ngrams(proposer: NgramProposer, running: list[Request], max_model_len: int) -> None:
    for request, room in proposal_candidates(running, max_model_len):
        request.spec_token_ids = proposer.propose(request.spec, request.all_token_ids, room)


def propose_with_draft(
    draft: DraftModel,
    running: list[Request],
    max_model_len: int,
    block_size: int,
    step_room: int,
    rows: RowTable,
    runner: ModelRunner,
) -> None:
    """The draft model's proposals for each running request caught up to its last token,
    up to its proposal length, what max_tokens and max_model_len leave, and the KV slots its
    blocks hold for the tokens the draft writes (the last and each proposal but the final
    one); in all, at most `step_room` (what the next step has room for: each costs a draft
    step), given in the order the scheduler takes them."""
    for request in running:
        request.spec_token_ids = []
    wanted = []
    for request, room in proposal_candidates(running, max_model_len):
        if not request.spec.wanted():
            continue
        slots = len(request.block_ids) * block_size - request.num_tokens + 1
        count = min(request.spec.length, room, slots, step_room)
        if count > 0:
            step_room -= count
            wanted.append((rows.row(request.request_id), request, count))
    if not wanted:
        return
    proposals = draft.propose(runner.block_table, runner.sampler_state.bias, wanted)
    for (_, request, _), tokens in zip(wanted, proposals, strict=True):
        request.spec_token_ids = tokens

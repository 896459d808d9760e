"""What a step reports for a request, by its output kind (cumulative, delta or final only).

A DELTA report carries only the tokens, logprobs and text that are new since the last one.
While the request runs, the last characters that could still begin a stop string are held
back, so the text reported never includes text that the stop would trim; the concatenated
deltas equal the final cumulative text.
"""

from __future__ import annotations

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.outputs import CompletionOutput
from jaxinfer.sampling_params import RequestOutputKind


def reports(request: Request) -> bool:
    """Whether this step's update of the request is reported at all."""
    kind = request.sampling_params.output_kind
    return kind is not RequestOutputKind.FINAL_ONLY or request.status.finished


def completion_output(request: Request, detokenizer: IncrementalDetokenizer) -> CompletionOutput:
    """The request's completion as its output kind reports it now."""
    params = request.sampling_params
    finished = request.status.finished
    text, token_ids = detokenizer.text, request.output_token_ids
    logprobs = request.logprobs if params.logprobs is not None else None
    if params.output_kind is RequestOutputKind.DELTA:
        first_token, first_char = request.num_reported_tokens, request.num_reported_chars
        hold = max(map(len, params.stop), default=1) - 1
        end = len(text) if finished else max(len(text) - hold, first_char)
        request.num_reported_tokens, request.num_reported_chars = len(token_ids), end
        text, token_ids = text[first_char:end], token_ids[first_token:]
        logprobs = logprobs[first_token:] if logprobs is not None else None
    return CompletionOutput(
        index=request.index,
        text=text,
        token_ids=list(token_ids),
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=request.status.value if finished else None,
        stop_reason=request.stop_reason,
    )

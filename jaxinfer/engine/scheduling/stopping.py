"""When a request ends: its stop conditions, checked token by token as a step's tokens are
applied (a stop string is the detokenizer's, jaxinfer.engine.detokenizer)."""

from __future__ import annotations

from jaxinfer.engine.scheduling.request import Request, RequestStatus


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    """How the request ends with its last output token, or None: EOS (unless ignore_eos), a
    stop token, a finished grammar, max_tokens or max_model_len; nothing before min_tokens
    but its length."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens < params.min_tokens:
        return length_status(request, max_model_len)
    if not params.ignore_eos and token in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if token in request.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if request.constraints is not None and request.constraints.finished:
        return RequestStatus.FINISHED_STOPPED  # the grammar allows nothing more
    return length_status(request, max_model_len)


def length_status(request: Request, max_model_len: int) -> RequestStatus | None:
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and request.num_output_tokens >= max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def sampled_enough(request: Request, max_model_len: int) -> bool:
    """True when the steps in flight already sample the request's last token."""
    max_tokens = request.sampling_params.max_tokens
    num_outputs = request.num_output_tokens + request.num_output_placeholders
    return (max_tokens is not None and num_outputs >= max_tokens) or (
        request.num_tokens_with_placeholders >= max_model_len
    )

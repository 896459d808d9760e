"""What a step reports: the sampled tokens and logprobs brought to the host (step_output,
record_prompt_logprobs), and each request's report by its output kind (cumulative, delta or
final only).

A DELTA report carries only the tokens, logprobs and text that are new since the last one.
While the request runs, the last characters that could still begin a stop string are held
back, so the text reported never includes text that the stop would trim; the concatenated
deltas equal the final cumulative text.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.execution import pooling
from jaxinfer.engine.execution.step import DispatchedStep, SchedulerOutput, StepOutput
from jaxinfer.engine.sampling.sampler import SamplerOutput
from jaxinfer.engine.scheduling.request import Request, RequestStatus
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.parallel.host import fetch
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


def request_output(request: Request, detokenizer: IncrementalDetokenizer) -> RequestOutput:
    """The report of a request without siblings (n = 1)."""
    first_report = request.num_reported_tokens == 0
    completion = completion_output(request, detokenizer)
    prompt_logprobs = request.prompt_logprobs
    if request.sampling_params.output_kind is RequestOutputKind.DELTA and not first_report:
        prompt_logprobs = None  # reported once, with the first delta
    embedding = None
    if request.pooling is not None and request.status.finished:
        embedding = pooling.embedding(request)
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion],
        finished=request.status.finished,
        metrics=request.metrics,
        prompt_logprobs=prompt_logprobs,
        embedding=embedding,
    )


def step_output(scheduler_output: SchedulerOutput, sampled: SamplerOutput) -> StepOutput:
    """The step's sampled tokens and logprobs on the host, by request."""
    host = fetch(sampled)  # the one device-to-host transfer of the step
    num_rows = sum(item.num_sample_rows for item in scheduler_output.scheduled)
    flat = host.token_ids[:num_rows].tolist()
    token_ids, logprobs = [], []
    first = 0
    for item in scheduler_output.scheduled:
        rows = range(first, first + item.num_sample_rows)
        first = rows.stop
        token_ids.append(flat[rows.start : rows.stop])
        wanted = item.params.logprobs
        if wanted is None or not item.samples:
            logprobs.append([None] * len(rows))
            continue
        logprobs.append(
            [
                logprob_entry(
                    host.top_ids[row],
                    host.top_logprobs[row],
                    wanted,
                    flat[row],
                    host.sampled_logprobs[row],
                )
                for row in rows
            ]
        )
    return StepOutput(token_ids=token_ids, logprobs=logprobs)


def record_prompt_logprobs(step: DispatchedStep, requests: dict[str, Request]) -> None:
    """Appends each prompt position's logprobs to its request in `requests` (once: a chunk recomputed
    after a preemption adds nothing)."""
    if step.prompt_rows is None:
        return
    chosen, top_ids, top_logprobs = (
        np.concatenate(part)[: len(step.prompt_rows.rows)]
        for part in zip(*fetch(step.prompt_logprobs), strict=True)
    )
    offset = 0
    for row, position, count in step.prompt_rows.spans:
        item = step.scheduler_output.scheduled[row]
        request = requests.get(item.request_id)
        wanted = item.params.prompt_logprobs
        valid = (
            request is not None
            and request.status is RequestStatus.RUNNING
            and request.epoch == item.epoch
        )
        for j in range(count):
            if valid and position + j == len(request.prompt_logprobs):
                row = offset + j
                request.prompt_logprobs.append(
                    logprob_entry(
                        top_ids[row],
                        top_logprobs[row],
                        wanted,
                        request.prompt_token_ids[position + j],
                        chosen[row],
                    )
                )
        offset += count


def record_pooled(step: DispatchedStep, requests: dict[str, Request]) -> None:
    """Adds the step's pooled sums to its embedding requests (jaxinfer.engine.execution.pooling);
    a request's first chunk (again after a preemption) starts its sums afresh."""
    if step.pooling_rows is not None:
        scheduled = step.scheduler_output.scheduled
        pooling.record(requests, scheduled, step.pooling_rows, fetch(step.pooled))


def logprob_entry(ids, logprobs, count: int, token: int, token_logprob) -> dict[int, float]:
    """The `count` most likely tokens' logprobs (rows of the sampler's top ids and logprobs)
    and the chosen token's, by token id."""
    top = dict(zip(ids[:count].tolist(), logprobs[:count].tolist(), strict=True))
    top[token] = float(token_logprob)
    return top

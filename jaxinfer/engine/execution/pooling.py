"""Embedding requests on the generation path: a request with PoolingParams is a prompt that
samples one token (never reported), and each step that computes some of its prompt also sums
the final-norm hidden states of the tokens its pooling takes (all of them for mean, the first
for CLS, the last for last), so chunked prefill, batching with other requests and
preemption need nothing of their own. The engine adds each step's sums to the request
(record) and the finished request's embedding is the mean or the one state, truncated to
`dimensions` and normalized (embedding). Mean and CLS pooling take no prefix-cache hits
(their states must be computed); last pooling's last token always is.

S: the step's request rows (max_num_seqs), N: pooled tokens (padded), E: hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.execution.step import PoolingRows, ScheduledRequest

MIN_ROWS = 16  # pooled tokens are padded to a power of two from here (few compilations)


def pooled_span(item: ScheduledRequest, first: int, count: int) -> tuple[int, int]:
    """(offset in the step's tokens of the request, count) of the tokens this step pools:
    positions [first, first + count) of which the prompt's are pooled."""
    prompt = item.num_prompt_tokens
    kind = item.pooling.pooling
    if kind == "mean":
        return 0, max(0, min(first + count, prompt) - first)
    position = 0 if kind == "cls" else prompt - 1
    if first <= position < first + count:
        return position - first, 1
    return 0, 0


def pooling_rows(spans: list[tuple[int, int, int, int]]) -> PoolingRows | None:
    """The step's pooled tokens from (batch row, flat start, offset, count) spans."""
    spans = [s for s in spans if s[3] > 0]
    if not spans:
        return None
    rows = np.concatenate([np.arange(s + o, s + o + n, dtype=np.int32) for _, s, o, n in spans])
    segments = np.concatenate([np.full(n, row, np.int32) for row, _, _, n in spans])
    size = max(MIN_ROWS, 1 << (len(rows) - 1).bit_length())
    padded_rows = np.zeros(size, np.int32)
    padded_rows[: len(rows)] = rows
    padded_segments = np.full(size, np.iinfo(np.int32).max, np.int32)  # dropped by the sum
    padded_segments[: len(rows)] = segments
    counts = tuple((row, n) for row, _, _, n in spans)
    return PoolingRows(padded_rows, padded_segments, counts)


def pooled_sums(
    rms_norm, norm_weight, eps: float, hidden, rows, segments, num_segments: int
) -> jax.Array:  # f32[S, E]
    """The final norm of hidden[rows] ([N, E]), summed per segment (batch row)."""
    x = rms_norm(hidden[rows], norm_weight, eps).astype(jnp.float32)
    return jax.ops.segment_sum(x, segments, num_segments=num_segments)


def record(requests: dict, scheduled, rows: PoolingRows, sums: np.ndarray) -> None:
    """Adds a step's sums (f32[S, E], fetched) to its embedding requests (those still in the
    admission that scheduled the step)."""
    for row, count in rows.counts:
        item = scheduled[row]
        request = requests.get(item.request_id)
        if request is None or request.pooling is None or request.epoch != item.epoch:
            continue  # finished, aborted or preempted since
        if item.num_computed_tokens == 0:  # the prompt's first chunk (again after a preemption)
            request.pooled, request.num_pooled = None, 0
        request.pooled = sums[row] if request.pooled is None else request.pooled + sums[row]
        request.num_pooled += count


def embedding(request) -> np.ndarray | None:
    """A finished embedding request's vector: f32[E, or dimensions] (checked against E at
    the entry points); None where it pooled nothing (aborted)."""
    if request.pooled is None or request.num_pooled == 0:
        return None
    vector = request.pooled / request.num_pooled
    pooling = request.pooling
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


_pooled_sums = jax.jit(pooled_sums, static_argnums=(0, 2, 6))


def dispatch(runner, rows: PoolingRows) -> jax.Array:
    """Enqueues the sums of a step just executed (runner.last_hidden): f32[S, E] on the device."""
    arch = runner.config.model.arch
    return _pooled_sums(
        runner.kernels.rms_norm,
        runner.top_params["norm"],
        arch.rms_norm_eps,
        runner.last_hidden,
        rows.rows,
        rows.segments,
        runner.config.scheduler.max_num_seqs,
    )

"""A request's host-side state while the engine works on it, and a request for n > 1
samples (ParentRequest)."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jaxinfer.engine.sampling.constraints import RequestConstraints
from jaxinfer.engine.scheduling.lora_slots import SlotAdapter
from jaxinfer.engine.speculation.state import SpecState
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import RequestOutputKind, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence. The scheduler's only rule: bring num_computed_tokens up to num_tokens.

    num_tokens counts the tokens known on the host. A step that samples for the request adds
    a placeholder when it is scheduled; the sampled token replaces it when the step's results
    are processed, so with async scheduling the next step is scheduled (its input read on the
    device) before the host knows that token.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt.
        sampling_params: how to sample.
        eos_token_ids: the model's end-of-sequence tokens (ignored with ignore_eos).
        seed: the random stream of this request (the user's seed, or fresh entropy).
        priority: lower runs first (and is preempted last); equal priorities are FCFS.
        cache_salt: isolates this request's prefix-cache entries from other tenants'.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    metrics: RequestMetrics
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    arrival_index: int = 0  # tie-break of equal priorities: admission order
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # DeepSeek-V4's compressed entries' blocks, by store ("csa", "hca"), in entry order
    entry_block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full blocks
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    # Tokens sampled by steps still in flight (async scheduling): counted as computed inputs
    # of the next step before their values reach the host.
    num_output_placeholders: int = 0
    # Set at each admission (unique in the scheduler): results of steps scheduled before the
    # request was last admitted (a preemption since, or another request of the same id) are
    # dropped.
    epoch: int = 0
    bias: np.ndarray | None = None  # f32[V], fixed logit bias (see constraints.bias_row)
    constraints: RequestConstraints | None = None  # per-step token bitmask rows
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by prompt position
    parent: ParentRequest | None = None  # set for the samples of an n > 1 request
    index: int = 0  # which of the parent's samples
    stop_token_ids: frozenset[int] | None = None  # default: sampling_params.stop_token_ids
    # An embedding request: its pooling, and the sums of its prompt's final-norm hidden
    # states the steps computed (jaxinfer.engine.pooling).
    pooling: PoolingParams | None = None
    pooled: np.ndarray | None = None  # f32[E]
    num_pooled: int = 0
    # What DELTA outputs have reported so far (output tokens, characters of text).
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    spec: SpecState | None = None  # its speculative decoding state (None: it never proposes)
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # for the next step
    lora: SlotAdapter | None = None  # its LoRA adapter (jaxinfer.engine.scheduling.lora_slots)
    lora_slot: int = -1  # the adapter's device slot while the request runs
    # A hybrid model's prefix hit: the checkpoint slot its states are restored from
    # (jaxinfer.engine.scheduling.state_checkpoints; -1: none).
    state_restore: int = -1

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)
        if self.stop_token_ids is None:
            self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Fills the oldest placeholder with the token sampled for it."""
        assert self.num_output_placeholders > 0, "a token arrived that no step was sampling"
        self.num_output_placeholders -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_accepted_token(self, token_id: int) -> None:
        """Appends a token a step sampled after an accepted proposal (no placeholder: the
        proposal's position was scheduled as a computed token)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops the output tokens past the first num_output_tokens (a finished request whose
        stop string ended earlier than the step's last accepted token)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]
            del self.logprobs[num_output_tokens:]


@dataclasses.dataclass(eq=False)
class ParentRequest:
    """A request for n > 1 samples: n child requests whose outputs are reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    # The latest report of each child, by index (None before its first). With DELTA output,
    # the reports of one step, cleared once reported.
    completions: list[CompletionOutput | None]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_finished: int = 0
    reported_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)

    def update(self, child: Request, completion: CompletionOutput) -> None:
        self.completions[child.index] = completion
        if completion.finish_reason is not None:
            self.num_finished += 1

    def output(self) -> RequestOutput | None:
        """What to report after a step that updated some children, or None (a FINAL_ONLY
        request before its last child finishes). Samples without a report are left out."""
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        prompt_logprobs = self.children[0].prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            if self.reported_prompt_logprobs:
                prompt_logprobs = None
            self.reported_prompt_logprobs = True
        outputs = [c for c in self.completions if c is not None]
        if self.output_kind is RequestOutputKind.DELTA:
            self.completions = [None] * len(self.completions)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.children[0].metrics,
            prompt_logprobs=prompt_logprobs,
        )

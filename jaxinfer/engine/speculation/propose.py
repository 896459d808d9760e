"""Each step's proposals: which running requests propose (caught up to their last token, with
room left), and what they propose, by n-grams, suffix indexes, the draft model or the MTP
layer."""

from __future__ import annotations

import time

from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.execution.row_table import RowTable
from jaxinfer.engine.execution.step import ScheduledRequest, SchedulerOutput
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.scheduling.stats import SpecStats
from jaxinfer.engine.speculation.candidates import DraftRun, proposal_candidates
from jaxinfer.engine.speculation.control import SpecControl
from jaxinfer.engine.speculation.draft_model import DraftModel
from jaxinfer.engine.speculation.mtp import MtpProposer, propose_with_mtp
from jaxinfer.engine.speculation.ngram import NgramIndex, NgramProposer
from jaxinfer.engine.speculation.state import SpecState
from jaxinfer.engine.speculation.suffix import SuffixProposer

HostProposer = NgramProposer | SuffixProposer

# A draft model that is not paid for costs its steps anyway (the catch-up of a request whose
# last proposal was all accepted, the prompt chunks of new requests). So a request the draft
# could have proposed for in this many steps in a row, and did not, leaves it (draft_off);
# after this many requests in a row left it with no proposal taken in between, new requests
# start without it but one in PROBE_EVERY, which measures whether it pays again.
DRAFT_PATIENCE = 8
IDLE_AFTER = 4
PROBE_EVERY = 16


def make_proposer(config: SpeculativeConfig) -> HostProposer | None:
    """The host-side proposer of config.method (None: none, or a draft model's)."""
    if config.method in ("none", "draft"):
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"unknown speculative_method {config.method!r}")


def propose_on_host(
    proposer: HostProposer, scheduler: Scheduler, control: SpecControl | None
) -> None:
    """The host proposer's proposals for each running request caught up to its last token.
    Each indexes its new tokens (every token once, whether it proposes or not); with
    SpecControl's plans, they look up proposals only where a plan with every candidate at
    its limit, the lookups' time paid (control.observe_host), takes some (which requests'
    lookups find proposals is not known before: all look up, and the scheduler plans over
    what they found); else only their rests are counted down."""
    candidates = list(proposal_candidates(scheduler.running, scheduler.config.max_model_len))
    for request, _ in candidates:
        proposer.index(request.spec, request.all_token_ids)
    if control is not None and candidates:
        wanted = [
            (request, max(min(at_most(request.spec), room), 0)) for request, room in candidates
        ]
        used, num_sampling = scheduler.proposal_room()
        if not any(scheduler.plan_proposals(used, num_sampling, wanted, host_rows=len(wanted))):
            for request, _ in candidates:
                request.spec.wanted()  # (a resting request's step)
                request.spec.declined()
            candidates = []
    start = time.perf_counter()
    for request, room in candidates:
        request.spec_token_ids = proposer.propose(request.spec, request.all_token_ids, room)
    if control is not None:
        control.observe_host(len(candidates), time.perf_counter() - start)


def at_most(spec: SpecState) -> int:
    """The most proposals a request's host proposer makes now (none while it rests)."""
    return spec.limit if spec.length else 0


def propose_with_draft(
    draft: DraftModel,
    scheduler: Scheduler,
    block_size: int,
    rows: RowTable,
    runner: ModelRunner,
) -> DraftRun:
    """The draft model's proposals for each running request caught up to its last token,
    up to its proposal length, what max_tokens and max_model_len leave, and the KV slots its
    blocks hold for the tokens the draft writes (the one before the last, the last and each
    proposal but the final one); in all, as many as the scheduler's plan says pay for their
    time and the draft's steps (Scheduler.plan_proposals). A request that proposes nothing
    now but whose final proposal, all accepted, the draft never fed takes the first step
    anyway (its proposal dropped): else the draft would miss that token for good; but one
    that took none in DRAFT_PATIENCE steps in a row, or whose draft missed a token, leaves
    the draft (SpecState.draft_off)."""
    running = scheduler.running
    for request in running:
        request.spec_token_ids = []
        if request.spec is not None:  # (back over the proposals the last step rejected)
            spec = request.spec
            spec.draft_computed = min(spec.draft_computed, request.num_computed_tokens)
            if spec.lookup_probe:  # (a probe the step did not take: as if rejected)
                spec.lookup_probe = False
                spec.record_failed_probe()
    wanted, idle = [], []
    feed = []  # probes whose last two tokens the draft runs over first (a dropped proposal)
    left = 0
    for request, room in proposal_candidates(running, scheduler.config.max_model_len):
        spec = request.spec
        if spec.copying:  # by lookup alone
            request.spec_token_ids = spec.index.propose(request.all_token_ids, spec.proposals(room))
            continue
        if spec.draft_off:
            continue
        # (the draft feeds the last two tokens first: it must hold the ones before, and the
        # last one's slot must be the request's)
        if spec.draft_computed < request.num_tokens - 2:
            spec.draft_off, left = True, left + 1
            continue
        slots = len(request.block_ids) * block_size - request.num_tokens + 1
        if slots < 1:
            continue
        if lookup_probe(request, room):
            if spec.draft_computed < request.num_tokens - 1:  # (it feeds the last two first)
                feed.append((rows.row(request.request_id), request, 1))
            continue
        count = min(spec.length, room, slots) if spec.wanted() else 0
        (wanted if count > 0 else idle).append((request, count))
    counts = []
    if wanted:
        used, num_sampling = scheduler.proposal_room()
        counts = scheduler.plan_proposals(used, num_sampling, wanted, draft_rows=len(wanted))
    chosen = [
        (rows.row(request.request_id), request, count)
        for (request, _), count in zip(wanted, counts, strict=True)
        if count
    ]
    behind = feed
    for request, _ in idle + [w for w, c in zip(wanted, counts, strict=True) if not c]:
        spec = request.spec
        spec.draft_declined += 1
        if spec.draft_declined >= DRAFT_PATIENCE:
            spec.draft_off, left = True, left + 1
        elif spec.draft_computed == request.num_tokens - 2:
            behind.append((rows.row(request.request_id), request, 1))
    for _, request, _ in chosen:
        request.spec.draft_declined = 0
    if not chosen and not behind:
        return DraftRun(left=left)
    proposals = draft.propose(runner.block_table, runner.sampler_state.bias, chosen + behind)
    for (_, request, _), tokens in zip(chosen, proposals, strict=False):
        request.spec_token_ids = tokens
    steps = max(count for _, _, count in chosen + behind)
    return DraftRun(len(chosen) + len(behind), steps, len(chosen), left)


def lookup_probe(request: Request, room: int) -> bool:
    """Whether the request tries prompt lookup's proposals this step in place of the draft's
    (SpecState.lookup_probe, draft_prompt_lookup): the latest earlier occurrence of its last
    prompt_lookup_max tokens is in its prompt. The draft runs over the step's tokens with it
    (DraftModel.extend), and over its last two tokens first where it has not
    (propose_with_draft), so it can take the request back."""
    spec = request.spec
    index = spec.index
    if index is None:
        return False
    if spec.probe_cooldown > 0:
        spec.probe_cooldown -= 1
        return False
    # (a run of its prompt: the output copies its input, as an edit does; a match in its own
    # output is as likely new code repeating a shape, which the draft proposes better)
    end = index.match(request.all_token_ids, min_n=index.max_n)
    if end is None or end >= request.num_prompt_tokens:
        return False
    tokens = index.follow(request.all_token_ids, end, min(spec.limit, room))
    request.spec_token_ids, spec.lookup_probe = tokens, True
    return True


class Speculation:
    """The engine's proposing: its host proposer (n-gram, suffix) or draft model, the
    SpecControl that plans each step's proposals from measured times, and the seconds spent
    proposing."""

    def __init__(self, config: EngineConfig, proposer: DraftModel | MtpProposer | None):
        """`proposer`: the draft model or MTP layer (speculative_method draft, mtp)."""
        self.config = config
        self.draft = proposer if isinstance(proposer, DraftModel) else None
        self.mtp = proposer if isinstance(proposer, MtpProposer) else None
        self.host = None if proposer is not None else make_proposer(config.speculative)
        self.control = None
        if (proposer is not None or self.host is not None) and config.speculative.adaptive:
            self.control = SpecControl(config.scheduler.token_buckets)
        self.seconds = 0.0  # spent proposing (host lookups, the draft's steps)
        self._drafted = 0.0  # the draft's steps since the last observed step
        self._accepted = 0  # proposals accepted since the start, at the last observed step
        self.left_in_row = 0  # requests that left the draft with no proposal taken since
        self.started_without = 0  # new requests started without the draft while it idles

    @property
    def on(self) -> bool:
        return self.draft is not None or self.mtp is not None or self.host is not None

    @property
    def follows_every_step(self) -> bool:
        """Whether the proposer runs over every step's outputs (the MTP layer), so that a
        step is processed before the next is dispatched."""
        return self.mtp is not None

    def new_state(self, requested: int | None) -> SpecState:
        """A request's state; `requested`: its own limit (None: the engine's)."""
        limit = self.config.speculative.num_speculative_tokens
        if requested is not None:
            limit = min(limit, requested)
        state = (self.draft or self.mtp or self.host).new_state(limit)
        speculative = self.config.speculative
        if self.draft is not None and speculative.draft_prompt_lookup:
            state.index = NgramIndex(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        if self.draft is not None and self.left_in_row >= IDLE_AFTER:
            self.started_without += 1
            state.draft_off = self.started_without % PROBE_EVERY != 0  # (one in 16 probes)
        return state

    def propose(
        self,
        scheduler: Scheduler,
        rows: RowTable,
        runner: ModelRunner,
        output: SchedulerOutput,
    ) -> None:
        """Sets the proposals of each running request caught up to its last token; `output`:
        the schedule of the step just processed."""
        start = time.perf_counter()
        if self.mtp is not None:
            block_size = self.config.cache.block_size
            run = propose_with_mtp(self.mtp, scheduler, block_size, rows, output)
            self._drafted += time.perf_counter() - start
            if self.control is not None and run.steps:
                self.control.observe_draft(run.rows, run.steps, self.mtp.steps_seconds)
        elif self.draft is None:
            propose_on_host(self.host, scheduler, self.control)
        else:
            block_size = self.config.cache.block_size
            run = propose_with_draft(self.draft, scheduler, block_size, rows, runner)
            self.left_in_row = 0 if run.proposing else self.left_in_row + run.left
            self._drafted += time.perf_counter() - start
            if self.control is not None:
                self.control.observe_draft(run.rows, run.steps, time.perf_counter() - start)
        self.seconds += time.perf_counter() - start

    def draft_extend(self, scheduled: tuple[ScheduledRequest, ...], requests) -> list[int] | None:
        """The requests (indices in the step) the draft must run over with the step
        (DraftModel.extend, over BatchBuilder.subset of the step), or None: it runs where some
        request it follows has tokens in the step not covered by the draft's own steps (a
        prompt chunk), over every request it follows. Requests it does not follow (no
        SpecState, or draft_off) are left out: their K/V in the draft's cache goes stale, so
        a later prefix-cache hit on their blocks gives the draft worse proposals, never a
        wrong token. `requests`: by id."""
        if self.draft is None:
            return None
        states = []
        for index, item in enumerate(scheduled):
            spec = requests[item.request_id].spec
            if spec is None or spec.draft_off:
                continue
            # A gap before the step's tokens stays one (the draft leaves the request), but
            # for an admission's prefix-cache hit, whose blocks the draft wrote when they
            # were first computed.
            if spec.draft_computed < item.num_computed_tokens and item.row_init is None:
                spec.draft_off = True
                continue
            states.append((index, spec, item))
        if all(
            item.num_new_tokens - len(item.draft_token_ids) == 1
            and spec.draft_computed >= item.num_computed_tokens
            and not (spec.lookup_probe and item.draft_token_ids)  # (not the draft's)
            for _, spec, item in states
        ):
            return None
        for _, spec, item in states:
            spec.draft_computed = item.num_computed_tokens + item.num_new_tokens
        return [index for index, _, _ in states]

    def finished(self, request: Request) -> None:
        if isinstance(self.host, SuffixProposer):
            self.host.finished(request.output_token_ids)

    def forget(self) -> None:
        """Forgets the finished outputs suffix decoding proposes from."""
        if isinstance(self.host, SuffixProposer):
            self.host.forget()

    def add_stats(self, stats: SpecStats) -> None:
        """Fills in what the scheduler does not know: the time spent proposing, the suffix
        index's size."""
        stats.proposing_seconds = self.seconds
        if isinstance(self.host, SuffixProposer):
            stats.suffix_cache_entries = self.host.cache.num_entries

    def observe_step(self, output: SchedulerOutput, seconds: float, num_accepted: int) -> None:
        """A step took `seconds`, the draft's proposing in it included (taken out of its
        time: the plan pays for the draft by its own times); `num_accepted`: the proposals
        accepted since the start (SpecStats), of which the ones since the last step are
        this step's. A step that only decoded and verified measures the rate too."""
        if self.control is not None:
            scheduled = output.scheduled
            num_sampling = sum(item.samples for item in scheduled)
            self.control.observe_step(
                output.num_scheduled_tokens, num_sampling, seconds - self._drafted
            )
            if scheduled and all(
                item.samples and item.num_new_tokens == item.num_sample_rows for item in scheduled
            ):
                tokens = num_sampling + num_accepted - self._accepted
                self.control.observe_tokens(num_sampling, tokens, seconds)
        self._accepted = num_accepted
        self._drafted = 0.0

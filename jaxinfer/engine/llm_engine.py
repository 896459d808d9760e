"""The engine: requests in, one scheduled and jitted step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

from jaxinfer.config import EngineOptions
from jaxinfer.engine import output_builder
from jaxinfer.engine.detokenizer import IncrementalDetokenizer, detokenize
from jaxinfer.engine.execution import pooling
from jaxinfer.engine.execution.step import DispatchedStep, SchedulerOutput, StepOutput, StepTiming
from jaxinfer.engine.input_processor import InputProcessor, PreparedRequest
from jaxinfer.engine.lora_adapters import LoraAdapters
from jaxinfer.engine.sampling.constraints import RequestConstraints
from jaxinfer.engine.schedule_check import check_same_schedule
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.request import ParentRequest, Request, RequestStatus
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.scheduling.stats import SchedulerStats
from jaxinfer.engine.speculation.propose import Speculation
from jaxinfer.engine.startup.start import describe, start_model
from jaxinfer.layers.kernel_registry import KernelRegistry
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import RequestMetrics, RequestOutput
from jaxinfer.parallel.distributed import seed_root
from jaxinfer.reasoning import ReasoningParser
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        options: EngineOptions,
        kernels: KernelRegistry | None = None,
        show_progress: bool = False,
    ):
        """`kernels`: where options.attention_impl, ffn_impl and norm_impl are looked up
        (default: the built-in implementations). `show_progress`: a progress bar of the
        warm-up's compilation (the log has its progress either way)."""
        started = start_model(options, kernels, show_progress)
        self.config, self.tokenizer, self.runner = started.config, started.tokenizer, started.runner
        style = self.config.model.reasoning_parser
        self.reasoning = ReasoningParser(style) if style is not None else None
        self.eos_token_ids, self.draft = started.eos_token_ids, started.draft
        self.partitioner, self.gguf_weights = started.partitioner, started.gguf_weights
        self.batch_builder = started.batch_builder
        self.background_compile = started.background_compile
        self.warmup_seconds, self.warmup_programs = started.warmup_seconds, started.warmup_programs
        self.warmup_cache_hits = started.warmup_cache_hits
        arch, folder = self.config.model.arch, started.folder
        self.kv_cache_manager = KVCacheManager.for_engine(self.config)
        self.speculation = Speculation(self.config, started.proposer)
        self.loras = LoraAdapters(self.config, self.runner) if self.config.lora else None
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv_cache_manager,
            arch.vocab_size,
            self.speculation.control,
            self.loras.slots if self.loras else None,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            folder / "tokenizer.json",
            arch.vocab_size,
            self.eos_token_ids,
            self.scheduler.check_admissible,
        )
        # Unseeded requests draw their seed from this root and their id (the same on every
        # process of a job; fixed by options.random_seed).
        self._seed_root = seed_root(options.random_seed)
        self._schedules = 0  # steps scheduled (check_schedule names them)
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._parents: dict[str, ParentRequest] = {}  # requests with n > 1, by id
        self._next_id = 0
        self.last_step_timing: StepTiming | None = None
        self._in_flight: DispatchedStep | None = None  # a step enqueued and not yet processed

    # -- requests --------------------------------------------------------------------------

    def prepare_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """Tokenizes and checks a request and builds what its samples share (grammar, bias
        row, bad words); raises ValueError if it could never be served. Thread-safe: the
        server calls it off the engine thread, so admitting the result costs the step loop
        almost nothing.

        Args:
            prompt: text, or token ids used as they are.
            params: how to sample.
            add_special_tokens: for text prompts; False for rendered chat templates.
            lora_request: the LoRA adapter to run with (read on first use; enable_lora).
        """
        prepared = self.input_processor.prepare(prompt, params, add_special_tokens)
        if lora_request is None:
            return prepared
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        return dataclasses.replace(prepared, lora=self.loras.get(lora_request))

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request | ParentRequest:
        """Tokenizes and admits a request; raises ValueError if it could never be served.

        Args:
            prompt: text, or token ids used as they are.
            params: how to sample; with n > 1, n samples run as child requests (their seeds
                seed + i when seeded) and share the prompt's KV blocks through the prefix
                cache; their outputs come together under request_id.
            request_id: unique id; one is made up when None.
            add_special_tokens: for text prompts; False for rendered chat templates.
            priority: lower is scheduled first and preempted last; FCFS among equals.
            cache_salt: prefix-cache entries are shared only among requests with the same salt.
            lora_request: the LoRA adapter it runs with (enable_lora).
        """
        prepared = self.prepare_request(prompt, params, add_special_tokens, lora_request)
        return self.add_prepared(prepared, request_id, priority, cache_salt)

    def add_prepared(
        self,
        prepared: PreparedRequest,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request | ParentRequest:
        """Admits a prepared request (see add_request for the arguments)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id is None:
            request_id = self._new_request_id()
        if request_id in self.requests or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = prepared.params
        if params.n == 1:
            return self._add_one(request_id, prepared, params, priority, cache_salt)
        parent = ParentRequest(
            request_id,
            prepared.prompt,
            prepared.prompt_token_ids,
            [],
            [None] * params.n,
            params.output_kind,
        )
        try:
            for index in range(params.n):
                child_id = f"{request_id}#{index}"
                if child_id in self.requests:
                    raise ValueError(f"request id {child_id!r} is already in use")
                # (The first sample reports the prompt's logprobs; the others need not
                # compute them, so they may start from the prefix cache.)
                child_params = params.for_sample(index)
                child = self._add_one(child_id, prepared, child_params, priority, cache_salt)
                child.parent, child.index = parent, index
                parent.children.append(child)
        except Exception:
            for child in parent.children:
                self.abort_request(child.request_id)
            raise
        self._parents[request_id] = parent
        return parent

    def _add_one(
        self,
        request_id: str,
        prepared: PreparedRequest,
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> Request:
        matcher = prepared.grammar.deep_copy() if prepared.grammar is not None else None
        waits = None  # the token the grammar waits for: the end of the output's reasoning
        if matcher is not None and self.reasoning is not None:
            prompt = prepared.prompt or self.tokenizer.decode(
                prepared.prompt_token_ids[-16:], False
            )
            waits = self.reasoning.grammar_start(prompt, self.tokenizer.encode)
        constraints = RequestConstraints(
            matcher, prepared.bad_words, params.min_tokens, prepared.stop_mask, waits
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            seed=params.seed if params.seed is not None else self._unseeded_seed(request_id),
            metrics=RequestMetrics(arrival_time=time.time()),
            prompt=prepared.prompt,
            priority=priority,
            cache_salt=cache_salt,
            bias=prepared.bias,
            constraints=constraints if constraints.active(0) else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            stop_token_ids=prepared.stop_token_ids,
            pooling=prepared.pooling,
            lora=prepared.lora,
        )
        if self.speculation.on and params.num_speculative_tokens != 0:
            request.spec = self.speculation.new_state(params.num_speculative_tokens)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer.tokenizer, params.skip_special_tokens
        )
        return request

    def _unseeded_seed(self, request_id: str) -> int:
        """A request's seed from the engine's seed root and its id (64 bits)."""
        text = f"{self._seed_root}/{request_id}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def _new_request_id(self) -> str:
        while str(self._next_id) in self.requests or str(self._next_id) in self._parents:
            self._next_id += 1
        self._next_id += 1
        return str(self._next_id - 1)

    def abort_request(self, request_id: str) -> None:
        """Aborts a request (all samples of an n > 1 one) at any stage; unknown ids are
        ignored (the request may have just finished)."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self.abort_request(child.request_id)
            return
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)
            self._detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix, and the outputs suffix decoding proposes from (for
        benchmarks, or after changing weights). Only when no request is unfinished; returns
        whether it did."""
        if self.scheduler.has_unfinished():
            return False
        self._in_flight = None
        self.speculation.forget()
        return self.kv_cache_manager.reset_prefix_cache()

    def describe(self) -> dict:
        """What the engine runs: the model, its sizes, and every option as resolved (with why,
        where "auto" chose); logged at start-up, returned by the server's GET /v1/engine."""
        return describe(self.config, self.gguf_weights, self.draft)

    def stats(self) -> SchedulerStats:
        """Running and waiting counts, KV usage, prefix-cache queries and hits, preemptions,
        speculative decoding's counts."""
        stats = self.scheduler.stats()
        if stats.spec is not None:
            self.speculation.add_stats(stats.spec)
        return stats

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Enqueues the next step and returns the outputs of the oldest step in flight.

        With async scheduling the device runs step N while the host schedules and enqueues
        step N+1 (whose decode inputs are step N's samples, read on the device) and only then
        waits for step N's tokens, so host work hides behind device work. Without it, each
        call runs one step to completion.
        """
        start = time.perf_counter()
        current, self._in_flight = self._in_flight, None
        if current is not None and not self.scheduler.has_unfinished():
            current = None  # everything in it finished or was aborted: nothing to process
        if current is None:
            current = self._schedule_and_dispatch()
            if current is None:
                return []
        if self.config.async_scheduling and not self._needs_tokens_on_host():
            self._in_flight = self._schedule_and_dispatch()
        overlapped = self._in_flight is not None and not current.sampled.token_ids.is_ready()
        step_output = output_builder.step_output(current.scheduler_output, current.sampled)
        output_builder.record_prompt_logprobs(current, self.requests)
        output_builder.record_pooled(current, self.requests)
        ready = time.perf_counter()
        outputs = self._process(current.scheduler_output, step_output)
        spec_stats = self.scheduler.spec_stats
        self.speculation.observe_step(
            current.scheduler_output,
            time.perf_counter() - start,
            spec_stats.num_accepted_tokens if spec_stats is not None else 0,
        )
        newest = self._in_flight or current  # the last step this call enqueued, if any
        self.last_step_timing = StepTiming(
            start=start,
            built=max(newest.built, start),
            dispatched=max(newest.dispatched, start),
            ready=ready,
            end=time.perf_counter(),
            num_tokens=current.scheduler_output.num_scheduled_tokens,
            num_reqs=len(current.scheduler_output.scheduled),
            overlapped=overlapped,
        )
        return outputs

    def _needs_tokens_on_host(self) -> bool:
        """True when a running request's next step depends on the tokens of the step in
        flight (grammars, multi-token bad words, proposals, the MTP layer's runs): then that
        step is processed first."""
        return self.speculation.follows_every_step or any(
            (r.constraints is not None and r.constraints.depends_on_tokens)
            or (r.spec is not None and r.spec.limit > 0)
            for r in self.scheduler.running
        )

    def _schedule_and_dispatch(self) -> DispatchedStep | None:
        scheduler_output = self.scheduler.schedule()
        self._schedules += 1
        if self.config.parallel.check_schedule:
            check_same_schedule(scheduler_output, self._schedules)
        if not scheduler_output.scheduled:
            return None
        now = time.time()
        for item in scheduler_output.scheduled:
            metrics = self.requests[item.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        host_step = self.batch_builder.build(scheduler_output)
        built = time.perf_counter()
        follow = self.speculation.draft_extend(scheduler_output.scheduled, self.requests)
        draft_inputs = (
            None if follow is None else self.batch_builder.subset(host_step.inputs, follow)
        )
        sampled, prompt_logprobs = self.runner.execute(host_step, draft_inputs)
        rows = host_step.pooling
        pooled = None if rows is None else pooling.dispatch(self.runner, rows)
        prompt_rows, dispatched = host_step.prompt_logprobs, time.perf_counter()
        return DispatchedStep(
            scheduler_output, sampled, prompt_rows, prompt_logprobs, built, dispatched, rows, pooled
        )

    def _process(
        self, scheduler_output: SchedulerOutput, step_output: StepOutput
    ) -> list[RequestOutput]:
        updated, finished = self.scheduler.update_from_output(scheduler_output, step_output)
        now = time.time()
        for request in updated:
            if request.status is RequestStatus.FINISHED_ABORTED:
                continue  # ended by a failed grammar, with no new token
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            else:
                metrics.inter_token_latencies.append(now - metrics.last_token_time)
            metrics.last_token_time = now
            detokenize(request, self._detokenizers[request.request_id], self.scheduler, finished)
        if self.speculation.on:
            self.speculation.propose(
                self.scheduler, self.batch_builder.rows, self.runner, scheduler_output
            )
        for request in finished:
            request.metrics.finished_time = now
            self.speculation.finished(request)
            if not isinstance(request.stop_reason, str):
                self._detokenizers[request.request_id].finish()
        outputs = []
        parents: dict[str, ParentRequest] = {}
        for request in updated:
            if request.parent is not None:  # one report per parent and step
                parent = request.parent
                if output_builder.reports(request):
                    detokenizer = self._detokenizers[request.request_id]
                    parent.update(request, output_builder.completion_output(request, detokenizer))
                parents[parent.request_id] = parent
            elif output_builder.reports(request):
                detokenizer = self._detokenizers[request.request_id]
                outputs.append(output_builder.request_output(request, detokenizer))
            if request.status.finished:
                del self.requests[request.request_id]
                del self._detokenizers[request.request_id]
        for parent in parents.values():
            output = parent.output()
            if output is not None:
                outputs.append(output)
            if parent.finished:
                self._parents.pop(parent.request_id, None)
        return outputs

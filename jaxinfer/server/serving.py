"""The OpenAI endpoints' work: requests in, engine requests on the shared step loop, bodies
and streams out.

Everything that grows with the input (chat templates, tokenizing, grammars, detokenizing)
runs off the event loop. A request holds its share of the server's sequence limit and its
engine requests for exactly as long as its response lives: a failure, a cancel or a client
that goes away at any point ends them.
"""

from __future__ import annotations

import dataclasses
import time

import fastapi
import pydantic

from jaxinfer.lora_request import LoRARequest
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server import chat_output, tool_calls
from jaxinfer.server import streams as engine_streams
from jaxinfer.server.admission import SequenceLimiter
from jaxinfer.server.async_engine import AsyncEngine, EngineDeadError
from jaxinfer.server.chat_output import ChoiceParser
from jaxinfer.server.errors import APIError
from jaxinfer.server.formatting import Formatter, Usage, json_response, tool_finish_reason
from jaxinfer.server.isolated_render import IsolatedRenderer
from jaxinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxinfer.server.request_ids import engine_id, response_id
from jaxinfer.server.streams import EngineStreamingResponse, Held
from jaxinfer.server.tool_calls import ToolPlan

BAD_REQUEST = (ValueError, TypeError, pydantic.ValidationError)
MAX_ERROR_CHARS = 1000  # of a template's error message in a response


@dataclasses.dataclass
class ChatStart:
    """A chat request admitted: what it holds, its sampling, tools and rendered prompt."""

    held: Held
    params: SamplingParams
    tool_plan: ToolPlan | None
    prompt: str


class OpenAIServing:
    """Args:
    engine: the engine loop.
    served_model_name: the model id clients name.
    max_queued_requests: sequences (prompts x n) held at once; None: no limit.
    allow_request_chat_template: accept `chat_template` in chat requests.
    chat_template_timeout: seconds a request's own chat template may take to render.
    max_rendered_chars: the longest text a chat template may produce.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        max_queued_requests: int | None,
        allow_request_chat_template: bool,
        chat_template_timeout: float,
        max_rendered_chars: int,
    ):
        self.engine = engine
        self.served_model_name = served_model_name
        self.allow_request_chat_template = allow_request_chat_template
        self.max_rendered_chars = max_rendered_chars
        self.isolated = IsolatedRenderer(chat_template_timeout, max_rendered_chars)
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.model.max_model_len
        self.vocab_size = engine.engine.config.model.arch.vocab_size
        self.limiter = SequenceLimiter(max_queued_requests)
        self.formatter = Formatter(self.tokenizer, served_model_name)
        self.loras: dict[str, LoRARequest] = {}  # the adapters served, by model name
        self.template_reads_tools = tool_calls.template_reads_tools(self.tokenizer.chat_template)
        self.reasoning = engine.engine.reasoning  # ReasoningParser, or None

    def check_model(self, model: str | None, generates: bool = True) -> LoRARequest | None:
        """The LoRA adapter the model named is (None: this model itself); 404 for another.
        `generates`: the request generates text, which an embedding-only server (runner
        pooling) refuses."""
        lora = self.loras.get(model) if model is not None else None
        if model is not None and model != self.served_model_name and lora is None:
            raise APIError(404, f"model {model!r} not found", "not_found_error")
        if generates and self.engine.engine.config.model.runner == "pooling":
            raise APIError(400, "this server serves embeddings only (runner 'pooling')")
        return lora

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, client_id: str | None = None):
        """client_id: the X-Request-Id header, if any: it labels the response (response_id)."""
        lora = self.check_model(body.model)
        request_id = response_id("cmpl", client_id)
        try:
            params = body.sampling_params()
            prompts = body.prompts()
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None
        held = Held(self.limiter.take(len(prompts) * params.n))
        try:
            await self._start(held, prompts, params, add_special_tokens=True, lora=lora)
            created = int(time.time())
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                chunks = self._completion_chunks(
                    request_id, created, held.streams, params, include_usage
                )
                response, held = EngineStreamingResponse(chunks, held.release), None
                return response
            finals = await engine_streams.finals(held.streams)

            def build() -> fastapi.Response:  # logprobs can be long: off the event loop
                usage = Usage()
                choices = []
                for p, final in enumerate(finals):
                    usage.add(final)
                    prompt_logprobs = self.formatter.prompt_logprobs(final.prompt_logprobs)
                    choices += [
                        self.formatter.completion_choice(
                            p * params.n + c.index, c, params.logprobs is not None, prompt_logprobs
                        )
                        for c in final.outputs
                    ]
                return json_response(
                    self.formatter.body(
                        request_id, created, "text_completion", choices, usage=usage.body()
                    )
                )

            return await self.engine.run_in_worker(build)
        finally:
            if held is not None:
                held.release()

    async def start_chat(self, body: ChatCompletionRequest) -> ChatStart:
        """A chat request validated, rendered and admitted (any chat API's first half); the
        caller releases `held` (or hands it to a streamed response)."""
        lora = self.check_model(body.model)
        if body.chat_template is not None and not self.allow_request_chat_template:
            raise APIError(400, "chat_template in a request is not allowed on this server")
        try:
            tool_plan = body.tool_plan()
            params = body.sampling_params(tool_plan)
            conversation = body.conversation()
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None
        held = Held(self.limiter.take(params.n))
        try:
            tools = None if tool_plan is None else tool_plan.rendered_tools
            prompt = await self.render(
                conversation,
                body.add_generation_prompt,
                body.chat_template,
                tools,
                body.chat_template_kwargs,
            )
            await self._start(held, [prompt], params, add_special_tokens=False, lora=lora)
        except BaseException:
            held.release()
            raise
        return ChatStart(held, params, tool_plan, prompt)

    def choice_parser(self, start: ChatStart) -> ChoiceParser:
        return ChoiceParser(self.reasoning, start.tool_plan, start.prompt)

    def whole_choice(self, start: ChatStart, c) -> tuple[tuple, int]:
        """((reasoning, content, tool calls), reasoning tokens) of a final output's choice."""
        parts = chat_output.whole(self.reasoning, start.tool_plan, start.prompt, c.text)
        decode = self.tokenizer.decode
        return parts, chat_output.count_reasoning(self.reasoning, start.prompt, c.token_ids, decode)

    async def chat(self, body: ChatCompletionRequest, client_id: str | None = None):
        """client_id: the X-Request-Id header, if any: it labels the response (response_id)."""
        request_id = response_id("chatcmpl", client_id)
        start = await self.start_chat(body)
        held, params, tool_plan = start.held, start.params, start.tool_plan
        try:
            created = int(time.time())
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                chunks = self._chat_chunks(request_id, created, start, include_usage)
                response, held = EngineStreamingResponse(chunks, held.release), None
                return response
            (final,) = await engine_streams.finals(held.streams)

            def build() -> fastapi.Response:
                usage = Usage(reasoning=self.reasoning is not None)
                usage.add(final)
                choices = []
                for c in final.outputs:
                    parts, thought_tokens = self.whole_choice(start, c)
                    if usage.reasoning_tokens is not None:
                        usage.reasoning_tokens += thought_tokens
                    choice = self.formatter.chat_choice(
                        c, params.logprobs is not None, tool_plan, parts, self.reasoning is not None
                    )
                    choices.append(choice)
                extra = {"usage": usage.body()}
                if final.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = self.formatter.prompt_logprobs(final.prompt_logprobs)
                body = self.formatter.body(request_id, created, "chat.completion", choices, **extra)
                return json_response(body)

            return await self.engine.run_in_worker(build)
        finally:
            if held is not None:
                held.release()

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model, generates=False)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages")
        text, add_special_tokens = body.prompt, body.add_special_tokens
        if body.messages is not None:
            try:
                conversation = ChatCompletionRequest(messages=body.messages).conversation()
            except BAD_REQUEST as error:
                raise APIError(400, str(error)) from None
            text = await self.render(conversation, body.add_generation_prompt, None)
            add_special_tokens = False
        tokens = await self.engine.run_in_worker(self.tokenizer.encode, text, add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model, generates=False)
        vocab = self.vocab_size

        def work():
            if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
                return None
            return self.tokenizer.decode(body.tokens, skip_special_tokens=False)

        text = await self.engine.run_in_worker(work)
        if text is None:
            raise APIError(400, f"token ids must be in [0, {vocab})")
        return {"prompt": text}

    # -- engine ----------------------------------------------------------------------------

    async def render(
        self,
        conversation: list[dict],
        add_generation_prompt: bool,
        chat_template: str | None,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text of a conversation: the model's template on a worker thread, or the
        request's own in a bounded child process; any failure of the template is a 400.
        `tools`: given to a template that reads them, else put in the conversation
        (jaxinfer.server.tool_calls.conversation_for)."""
        if chat_template is None:
            reads_tools = self.template_reads_tools
        else:  # untrusted: not even parsed here (it renders in a child process)
            reads_tools = "tools" in chat_template
        conversation = tool_calls.conversation_for(conversation, tools, reads_tools)
        tools = tools if reads_tools else None
        try:
            if chat_template is None:
                return await self.engine.run_in_worker(
                    self.tokenizer.apply_chat_template,
                    conversation,
                    add_generation_prompt,
                    self.max_rendered_chars,
                    tools,
                    template_kwargs,
                )
            variables = self.tokenizer.template_variables(
                conversation, add_generation_prompt, tools, template_kwargs
            )
            return await self.isolated.render(chat_template, variables)
        except Exception as error:  # a template's code may raise anything: its error
            message = str(error)
            if len(message) > MAX_ERROR_CHARS:
                message = message[:MAX_ERROR_CHARS] + "..."
            raise APIError(400, f"the chat template failed: {message}") from None

    async def _start(
        self,
        held: Held,
        prompts: list[str | list[int]],
        params: SamplingParams,
        add_special_tokens: bool,
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Prepares and admits every prompt (all or none: `held` closes them on failure), each
        under an engine id of the server's own (engine_id): unique per admission, so no
        client can name, end or steer another's request, and an unseeded request draws a
        fresh seed (the engine derives it from the id). `pooling`: embedding requests; `lora`:
        the LoRA adapter the request's model names."""
        try:
            prepared = [
                await self.engine.prepare(prompt, params, add_special_tokens, lora)
                for prompt in prompts
            ]
            if pooling is not None:
                prepared = [dataclasses.replace(p, pooling=pooling) for p in prepared]
            for request in prepared:
                length = len(request.prompt_token_ids)
                if (
                    params.max_tokens is not None
                    and length + params.max_tokens > self.max_model_len
                ):
                    raise ValueError(
                        f"the prompt has {length} tokens and max_tokens is {params.max_tokens}: "
                        f"more than max_model_len ({self.max_model_len})"
                    )
            admission = engine_id()
            for index, request in enumerate(prepared):
                held.streams.append(await self.engine.add(f"{admission}-{index}", request))
        except EngineDeadError as error:
            raise APIError(503, str(error), "engine_dead") from None
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None

    # -- streams ---------------------------------------------------------------------------

    async def _completion_chunks(self, request_id, created, streams, params, include_usage):
        usage = Usage()
        async for prompt_index, output in engine_streams.merge(streams):
            usage.add(output)
            for c in output.outputs:
                if not c.text and c.finish_reason is None:
                    continue
                choice = self.formatter.completion_choice(
                    prompt_index * params.n + c.index, c, params.logprobs is not None
                )
                yield self.formatter.body(request_id, created, "text_completion", [choice])
        if include_usage:
            yield self.formatter.body(
                request_id, created, "text_completion", [], usage=usage.body()
            )

    async def _chat_chunks(self, request_id, created, start: ChatStart, include_usage):
        params, tool_plan = start.params, start.tool_plan
        parsers = [self.choice_parser(start) for _ in range(params.n)]

        def chunk(choices, **extra):
            return self.formatter.body(
                request_id, created, "chat.completion.chunk", choices, **extra
            )

        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(params.n)
            ]
        )
        usage = Usage(reasoning=self.reasoning is not None)
        async for output in start.held.streams[0]:
            usage.add(output)
            for c in output.outputs:
                parser = parsers[c.index]
                if parser.in_reasoning:
                    usage.reasoning_tokens += len(c.token_ids)  # (text or not)
                if not c.text and c.finish_reason is None:
                    continue
                logprobs = None
                if params.logprobs is not None:
                    logprobs = {"content": self.formatter.chat_logprobs(c.token_ids, c.logprobs)}
                deltas = parser.feed(c.text, final=c.finish_reason is not None)
                finish_reason = c.finish_reason
                if parser.called:
                    finish_reason = tool_finish_reason(finish_reason, tool_plan)
                if not deltas and finish_reason is None:
                    continue  # text held back: it may open a call or a tag
                # Each delta its own chunk (a call is one); the step's logprobs ride on the
                # first, the finish on the last.
                deltas = deltas or [{}]
                for i, delta in enumerate(deltas):
                    last = i == len(deltas) - 1
                    if not delta and not last:
                        continue
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": logprobs if i == 0 else None,
                                "finish_reason": finish_reason if last else None,
                                "stop_reason": c.stop_reason if last else None,
                            }
                        ]
                    )
        if include_usage:
            yield chunk([], usage=usage.body())

"""OpenAI-compatible request bodies (pydantic), and their translation to SamplingParams.

Unknown fields are refused (400), never ignored, and so are values the API defines as
invalid: non-finite numbers, strings that are not valid Unicode (lone surrogates), an empty
`messages` list, `stream_options` without `stream`. Beside OpenAI's fields, the vLLM extras a
client may send in `extra_body` are accepted: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, skip_special_tokens, include_stop_str_in_output, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs (returned in non-streamed responses, as vLLM
does), structured_outputs. Chat requests take tools and tool_choice
(jaxinfer.server.tool_calls).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from jaxinfer.sampling_params import (
    MAX_N,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    body_fields,
)
from jaxinfer.server import tool_calls
from jaxinfer.server.tool_calls import ToolPlan

MAX_PROMPTS = MAX_N  # prompts in one completions request


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)


class _Body(_Strict):
    """A request body: every string in it must be valid Unicode."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        pending = [data]
        while pending:
            value = pending.pop()
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(
                        "strings must be valid Unicode (a lone surrogate was found)"
                    ) from None
            elif isinstance(value, dict):
                pending.extend(value.keys())
                pending.extend(value.values())
            elif isinstance(value, list):
                pending.extend(value)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(
    pydantic.create_model(  # the SamplingParams fields bodies pass through by name
        "_PassedThrough",
        __base__=_Body,
        **{name: (kind | None, None) for name, kind in body_fields().items()},
    )
):
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: dict[str, Any] | None = None

    def check_streaming(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available with stream: true")

    @property
    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (the rest keep their defaults)."""
        kwargs = {
            name: getattr(self, name) for name in body_fields() if getattr(self, name) is not None
        }
        if self.logit_bias is not None:
            try:
                kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        if self.structured_outputs is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        return kwargs


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"a request takes at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        self.check_streaming()
        return SamplingParams(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            best_of=self.best_of,
            output_kind=self.output_kind,
            **self.sampling_kwargs(),
        )


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = pydantic.Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = pydantic.Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # arguments always follow the schema under required / named


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(pydantic.BaseModel):
    # name, tool_call_id, ...: the template's
    model_config = pydantic.ConfigDict(extra="allow", allow_inf_nan=False)

    role: str = pydantic.Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    @pydantic.model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        if self.content is None and self.role in ("system", "developer", "user"):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan | None:
        """What the tools mean for this request (jaxinfer.server.tool_calls); ValueError for
        a choice that cannot be."""
        tools = None
        if self.tools:
            tools = [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        return tool_calls.plan(tools, choice, self.parallel_tool_calls)

    def conversation(self) -> list[dict[str, Any]]:
        messages = []
        for message in self.messages:
            content = message.content
            if isinstance(content, list):  # text parts only
                if any(part.get("type") != "text" for part in content):
                    raise ValueError("only text content parts are supported")
                content = "".join(part.get("text", "") for part in content)
            messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
        return messages

    def sampling_params(self, tool_plan: ToolPlan | None = None) -> SamplingParams:
        """max_tokens None (neither max_tokens nor max_completion_tokens given) generates up
        to max_model_len. A required or named tool choice constrains the output."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        self.check_streaming()
        kwargs = self.sampling_kwargs()
        constraint = tool_plan.constraint() if tool_plan is not None else None
        if constraint is not None:
            if "structured_outputs" in kwargs or (
                self.response_format is not None and self.response_format.type != "text"
            ):
                raise ValueError(
                    "tool_choice required or a named function constrains the output: give no "
                    "response_format or structured_outputs with it"
                )
            kwargs["structured_outputs"] = constraint
        if self.response_format is not None and self.response_format.type != "text":
            if "structured_outputs" in kwargs:
                raise ValueError("give response_format or structured_outputs, not both")
            if self.response_format.type == "json_object":
                kwargs["structured_outputs"] = StructuredOutputsParams(json_object=True)
            else:
                if self.response_format.json_schema is None:
                    raise ValueError("response_format json_schema needs a json_schema field")
                kwargs["structured_outputs"] = StructuredOutputsParams(
                    json=self.response_format.json_schema.schema_
                )
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            output_kind=self.output_kind,
            **kwargs,
        )


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

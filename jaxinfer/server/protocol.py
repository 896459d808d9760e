"""OpenAI-compatible request bodies (pydantic), and their translation to SamplingParams.

Unknown fields are refused (400), never ignored. Beside OpenAI's fields, the vLLM extras a
client may send in `extra_body` are accepted: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, skip_special_tokens, include_stop_str_in_output, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs, structured_outputs.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (the rest keep their defaults)."""
        names = [
            "n",
            "temperature",
            "top_p",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "stop_token_ids",
            "allowed_token_ids",
            "bad_words",
            "prompt_logprobs",
        ]
        kwargs = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
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
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        return SamplingParams(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            best_of=self.best_of,
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


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # name, tool_call_id, ...: the template's

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None

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

    def sampling_params(self, max_model_len: int, prompt_len: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        kwargs = self.sampling_kwargs()
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
        max_tokens = self.max_completion_tokens or self.max_tokens
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max_model_len - prompt_len,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            **kwargs,
        )


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def token_ids(self, tokenizer) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.prompt is not None:
            return tokenizer.encode(self.prompt, self.add_special_tokens)
        chat = ChatCompletionRequest(messages=self.messages)
        text = tokenizer.apply_chat_template(
            chat.conversation(), add_generation_prompt=self.add_generation_prompt
        )
        return tokenizer.encode(text, add_special_tokens=False)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

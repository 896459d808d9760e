"""Anthropic's Messages API request (POST /v1/messages) and its translation to the chat
request the engine runs (ChatCompletionRequest): system and messages (text, tool_use and
tool_result blocks), tools and tool_choice, max_tokens, stop_sequences, temperature, top_p,
top_k, thinking (enabled, adaptive or disabled: the template's enable_thinking; its budget is
checked as Anthropic does, the reasoning bounded by max_tokens), output_config.format (a JSON
schema: structured output). Unknown fields are refused, as everywhere on this server.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic

from jaxinfer.server.protocol import ChatCompletionRequest


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class AnthropicTool(_Strict):
    name: str = pydantic.Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: empty thinking blocks


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = pydantic.Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: None = None  # (no effort levels here: a value is refused)


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Strict):
    model: str | None = None
    max_tokens: int = pydantic.Field(ge=1)
    messages: list[AnthropicMessage] = pydantic.Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # (this server's: a seeded sample repeats)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # (user_id: the caller's own; nothing here reads it)

    def chat_request(self, reasoning: bool) -> ChatCompletionRequest:
        """The chat request this one is; ValueError for what cannot be. `reasoning`: whether
        the server parses reasoning (`thinking` needs it)."""
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for message in self.messages:
            messages += _chat_messages(message)
        fields: dict[str, Any] = dict(
            model=self.model,
            messages=messages,
            max_tokens=self.max_tokens,
            stream=self.stream,
            stream_options={"include_usage": True} if self.stream else None,
        )
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "parameters": tool.input_schema,
                        **({"description": tool.description} if tool.description else {}),
                    },
                }
                for tool in self.tools
            ]
        if self.tool_choice is not None:
            fields.update(_tool_choice(self.tool_choice))
        if self.thinking is not None:
            thinks = self.thinking.type != "disabled"
            if thinks and not reasoning:
                raise ValueError(
                    "thinking needs a server that parses reasoning (--reasoning_parser)"
                )
            budget = self.thinking.budget_tokens
            if self.thinking.type == "enabled" and (budget is None or budget < 1024):
                raise ValueError("thinking.budget_tokens must be at least 1024")
            if budget is not None and budget >= self.max_tokens:
                raise ValueError("thinking.budget_tokens must be less than max_tokens")
            fields["chat_template_kwargs"] = {"enable_thinking": thinks}
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        return ChatCompletionRequest(**fields)

    @property
    def omits_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError(
                f"{where}: only text blocks are supported here, got {block.get('type')!r}"
            )
        parts.append(block["text"])
    return "".join(parts)


def _chat_messages(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool_result blocks become tool
    messages (before its text), an assistant's tool_use blocks its tool_calls; an assistant's
    earlier thinking is not fed back (as the reasoning models' own templates drop it)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for block in message.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(_field(block, "text", str))
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(_field(block, "input", dict))
            calls.append(
                {
                    "id": _field(block, "id", str),
                    "type": "function",
                    "function": {"name": _field(block, "name", str), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            text = _text(content, "tool_result content") if content else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(
                {"role": "tool", "tool_call_id": _field(block, "tool_use_id", str), "content": text}
            )
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue
        else:
            raise ValueError(f"{message.role} content blocks of type {kind!r} are not supported")
    out = list(results)
    if message.role == "assistant":
        assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            assistant["tool_calls"] = calls
        out.append(assistant)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _field(block: dict, name: str, kind: type):
    value = block.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"a {block.get('type')} block needs {name} ({kind.__name__})")
    return value


def _tool_choice(choice: AnthropicToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice of type tool needs a name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields

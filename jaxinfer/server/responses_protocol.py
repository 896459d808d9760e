"""OpenAI's Responses API request (POST /v1/responses) and its translation to the chat request
the engine runs: `input` as text or items (messages, earlier function calls and their
outputs), `instructions`, `max_output_tokens`, `temperature` / `top_p`, function `tools` and
`tool_choice`, `text.format` (text, JSON schema, JSON object), `reasoning` (with a reasoning
parser), `previous_response_id` and `store`. Unknown fields are refused.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from jaxinfer.server.protocol import ChatCompletionRequest


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = pydantic.Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # (arguments always follow the schema under required / named)


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = pydantic.Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: None = None  # (no summaries here: a value is refused)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None  # (kept with the stored response, returned as is)
    user: str | None = None  # (the caller's own; nothing here reads it)
    seed: int | None = None  # (this server's: a seeded sample repeats)

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (`instructions` are not among them: they do not carry
        over to a later response)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ValueError(f"an input message's role must be user, system, developer "
                                     f"or assistant, got {role!r}")  # fmt: skip
                messages.append({"role": role, "content": _text(item.get("content"))})
            elif kind == "function_call":
                call = {
                    "id": _string(item, "call_id"),
                    "type": "function",
                    "function": {"name": _string(item, "name"), "arguments": _string(item, "arguments")},
                }  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get("content"):
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output)
                messages.append(
                    {"role": "tool", "tool_call_id": _string(item, "call_id"), "content": text}
                )
            elif kind == "reasoning":
                continue  # earlier reasoning is not fed back
            else:
                raise ValueError(f"input items of type {kind!r} are not supported")
        if not messages:
            raise ValueError("input must not be empty")
        return messages

    def chat_request(self, history: list[dict[str, Any]], reasoning: bool) -> ChatCompletionRequest:
        """The chat request this one is, after `history` (a stored response's conversation);
        ValueError for what cannot be."""
        messages = list(history) + self.input_messages()
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        fields: dict[str, Any] = dict(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            stream=self.stream,
            stream_options={"include_usage": True} if self.stream else None,
        )
        for name in ("temperature", "top_p", "seed", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                for tool in self.tools
            ]  # fmt: skip
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            if form.schema_ is None:
                raise ValueError("text.format json_schema needs a schema")
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": form.name or "output", "schema": form.schema_},
            }
        elif form is not None and form.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        if self.reasoning is not None and self.reasoning.effort is not None:
            if not reasoning:
                raise ValueError("reasoning needs a server that parses it (--reasoning_parser)")
            thinks = self.reasoning.effort not in ("none", "minimal")
            fields["chat_template_kwargs"] = {"enable_thinking": thinks}
        return ChatCompletionRequest(**fields)


def _text(content) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("a message's content must be a string or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"content parts of type {kind!r} are not supported")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text part needs text")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"a {item.get('type')} item needs {name} (a string)")
    return value

"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

The model writes each call as Hermes / Qwen 2.5 do (the format most open chat templates define,
SmolLM2's training data included):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block may also hold a list of such objects. The choices:

- "none": the prompt is rendered without the tools, and the output is content.
- "auto" (the default when tools are given): the output is parsed; each block becomes a tool
  call, the text around them the content.
- "required": the output is constrained (llguidance, a Lark grammar embedding each tool's JSON
  schema) to one or more blocks (one with parallel_tool_calls false), each naming one of the
  tools with arguments valid for its `parameters`; then parsed as under "auto".
- a named function: the output is constrained to that function's arguments (its schema) and
  returned as one call of it.

Rendering: a chat template that reads `tools` gets them as transformers passes them; one that
does not (the default model's) gets a system message listing them and the format. Earlier
calls and results in the conversation (assistant `tool_calls`, `tool` messages) go to a
template that reads them as they are; to one that does not, as the same blocks in the
assistant's content and `<tool_response>` blocks.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import jinja2.meta

from jaxinfer.chat_template import environment
from jaxinfer.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its sampling and its output.

    mode: "none", "auto", "required" or "named".
    tools: the request's tools (OpenAI's {"type": "function", "function": {...}}).
    named: the function a "named" choice calls.
    """

    mode: str
    tools: tuple[dict, ...]
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (auto, required, named)."""
        return self.mode != "none"

    @property
    def rendered_tools(self) -> list[dict] | None:
        return None if self.mode == "none" else list(self.tools)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces required and named choices (None for none and auto)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=parameters(self.function(self.named)))
        if self.mode != "required":
            return None
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        "arguments": parameters(t["function"]),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
        }
        repeat = ' ("\\n" call)*' if self.parallel else ""
        grammar = (
            f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(calls)}\n"
        )
        return StructuredOutputsParams(grammar=grammar)

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parameters(function: dict) -> dict:
    """A function's arguments schema (any object when it declares none)."""
    return function.get("parameters") or {"type": "object"}


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); ValueError for a choice that cannot be."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    parallel = True if parallel is None else parallel
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {CHOICES} or a named function")
        return ToolPlan(tool_choice, tuple(tools), parallel=parallel)
    name = tool_choice["function"]["name"]
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")
    return ToolPlan("named", tuple(tools), named=name, parallel=parallel)


# -- prompts -----------------------------------------------------------------------------


def template_reads_tools(source: str | None) -> bool:
    """Whether a chat template uses the `tools` variable."""
    if not source:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(environment().parse(source))


def system_prompt(tools: list[dict]) -> str:
    """The tools and the call format, for a template that does not render tools itself."""
    listed = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
    return (
        f"You may call these functions:\n<tools>\n{listed}\n</tools>\n"
        f'To call one, reply with:\n{OPEN}\n{{"name": ..., "arguments": {{...}}}}\n{CLOSE}'
    )


def conversation_for(
    messages: list[dict], tools: list[dict] | None, reads_tools: bool
) -> list[dict]:
    """The messages a template that does not read tools can render: the tools as a system
    message, earlier calls as blocks in the assistant's content, results as
    <tool_response> blocks. A template that reads tools gets the messages as they are."""
    if reads_tools:
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            blocks = [
                f"{OPEN}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": _arguments(c["function"])}
                )
                + f"\n{CLOSE}"
                for c in calls
            ]
            text = "\n".join([message.get("content") or "", *blocks]).strip()
            message = {"role": "assistant", "content": text}
        elif message.get("role") == "tool":
            message = {
                "role": "tool",
                "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>",
            }
        out.append(message)
    if tools:
        prompt = system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(function: dict) -> Any:
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON (or nested past the parser): as it is
            return arguments
    return arguments


# -- output ------------------------------------------------------------------------------


def new_call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def calls_in_block(text: str) -> list[dict] | None:
    """The calls one block's JSON holds (an object or a list of them), or None if it is not
    that: whatever the model wrote (nested past the parser's depth, say), never an error."""
    try:
        value = json.loads(text)
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            calls.append(new_call(item["name"], arguments))
    except (ValueError, RecursionError):  # (json.JSONDecodeError is a ValueError)
        return None
    return calls


def parse(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output."""
    if tool_plan.mode == "named":
        return None, [new_call(tool_plan.named, text)]
    stream = CallStream(tool_plan)
    deltas = [*stream.feed(text), *stream.finish()]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    for call in calls:
        del call["index"]
    content = content.strip() if calls else content
    return content or None, calls


class CallStream:
    """One choice's output, text delta by text delta, as chat-completion deltas: content, and
    each call as one tool_calls delta once its block closes (a named choice streams its
    arguments as they come). Text that might open a block is held until it is known."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan = tool_plan
        self.buffer = ""
        self.in_block = False
        self.calls = 0
        self.space = ""  # whitespace held until text follows it

    def feed(self, text: str) -> list[dict]:
        if self.plan.mode == "named":
            return self._named(text)
        self.buffer += text
        deltas = []
        while True:
            if self.in_block:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return deltas
                block, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE) :]
                self.in_block = False
                deltas += self._block(block)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                deltas += self._content(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN) :]
                self.in_block = True
                continue
            keep = _partial_suffix(self.buffer, OPEN)
            deltas += self._content(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return deltas

    def finish(self) -> list[dict]:
        """What is held at the end: an unclosed block or a partial tag is content."""
        if self.plan.mode == "named":
            return []
        rest = (OPEN if self.in_block else "") + self.buffer
        self.buffer, self.in_block = "", False
        return self._content(rest)

    def _content(self, text: str) -> list[dict]:
        """Whitespace waits for text after it (so the newlines around blocks, and at the
        end, are not content), whichever deltas it came in."""
        if not text.strip():
            self.space += text
            return []
        text, self.space = self.space + text, ""
        return [{"content": text}]

    def _block(self, block: str) -> list[dict]:
        calls = calls_in_block(block)
        if calls is None:  # not a call after all: the text as it was
            return self._content(f"{OPEN}{block}{CLOSE}")
        out = []
        for call in calls:
            out.append({"tool_calls": [{"index": self.calls, **call}]})
            self.calls += 1
        return out

    def _named(self, text: str) -> list[dict]:
        if self.calls == 0:
            self.calls = 1
            call = new_call(self.plan.named, text)
            return [{"tool_calls": [{"index": 0, **call}]}]
        if not text:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: a tag may be
    split across deltas)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0

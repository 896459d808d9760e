"""One chat choice's output, as the parts every chat API shows: reasoning (jaxinfer.reasoning,
where the engine parses it), content, and tool calls (jaxinfer.server.tool_calls, parsed out
of the content only). The OpenAI and Anthropic endpoints format the same parts."""

from __future__ import annotations

from jaxinfer.reasoning import ReasoningParser, reasoning_tokens
from jaxinfer.server import tool_calls
from jaxinfer.server.tool_calls import ToolPlan


class ChoiceParser:
    """A choice's text, delta by delta, as chat-completion deltas in order: `reasoning_content`
    first, then `content` and `tool_calls` deltas (each call one delta once its block closes;
    a named choice's arguments as they come). Text that may be a tag is held until known."""

    def __init__(self, reasoning: ReasoningParser | None, tool_plan: ToolPlan | None, prompt: str):
        self.splitter = reasoning.splitter(prompt) if reasoning is not None else None
        parses = tool_plan is not None and tool_plan.parses
        self.calls = tool_calls.CallStream(tool_plan) if parses else None
        self.called = False  # a tool call was made

    @property
    def in_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.in_reasoning

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas `text` decides; `final`: the output's last text (nothing is held)."""
        thought = ""
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
            if final:
                more_thought, more_text = self.splitter.finish()
                thought, text = thought + more_thought, text + more_text
        deltas = [{"reasoning_content": thought}] if thought else []
        if self.calls is None:
            return deltas + ([{"content": text}] if text else [])
        deltas += self.calls.feed(text)
        if final:
            deltas += self.calls.finish()
        self.called |= any("tool_calls" in d for d in deltas)
        return deltas


def whole(
    reasoning: ReasoningParser | None, tool_plan: ToolPlan | None, prompt: str, text: str
) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning, content, tool calls) of a whole output: None for a part it does not have."""
    thought, content = None, text
    if reasoning is not None:
        thought, content = reasoning.split(prompt, text)
    calls = []
    if tool_plan is not None and tool_plan.parses and content is not None:
        content, calls = tool_calls.parse(content, tool_plan)
    return thought, content, calls


def count_reasoning(reasoning: ReasoningParser | None, prompt: str, token_ids, decode) -> int:
    """The output's reasoning tokens (0 where the engine parses none)."""
    if reasoning is None:
        return 0
    return reasoning_tokens(reasoning, prompt, list(token_ids), decode)

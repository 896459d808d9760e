"""Reasoning output: a model's `<think>...</think>` block split from its answer, as
`reasoning_content` beside `content` (EngineOptions.reasoning_parser).

Two styles, as vLLM names them:
- "qwen3": reasoning only where the output opens with the start tag (leading whitespace
  aside), or where the prompt itself ends with it (a template that opens the block, as Qwen3's
  thinking templates and DeepSeek-R1's do); an output with no block is all content.
- "deepseek_r1": the output starts in reasoning whether or not it writes the start tag (R1's
  template opens the block in the prompt; its distills sometimes repeat it).

Either way the reasoning ends at the end tag; text after it is content. A block that never
closes (the answer cut by max_tokens, or a model still thinking) is all reasoning.

`ReasoningSplitter` takes the output's text in pieces (a stream's deltas, or the whole text at
once) and returns (reasoning, content) pieces; a piece that may be the start of a tag split
over deltas is held until the next one or `finish()` decides it.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config.options import REASONING_STYLES as STYLES

START, END = "<think>", "</think>"

# States of a splitter.
_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """A style and its tags; `splitter(prompt)` for each output."""

    style: str
    start: str = START
    end: str = END

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"reasoning_parser must be one of {list(STYLES)}, got {self.style!r}")

    def starts_inside(self, prompt: str) -> bool:
        """Whether an output of `prompt` (its text) begins inside the block: deepseek_r1's
        always do, qwen3's where the prompt ends with the start tag (the template opened it)."""
        return self.style == "deepseek_r1" or prompt.rstrip().endswith(self.start)

    def grammar_start(self, prompt: str, encode) -> int | None:
        """The token a structured output of `prompt` waits for before its grammar applies:
        the end tag where the output starts inside the block (a ValueError where the tag is
        not one token of the tokenizer, `encode(text, add_special_tokens)`); None where the
        grammar applies from the first token (a qwen3 output the prompt did not open: a
        structured answer then has no reasoning)."""
        if not self.starts_inside(prompt):
            return None
        ids = encode(self.end, False)
        if len(ids) != 1:
            raise ValueError(
                f"a structured output after reasoning needs {self.end!r} to be one token of "
                f"the model's tokenizer (it is {len(ids)})"
            )
        return ids[0]

    def splitter(self, prompt: str) -> ReasoningSplitter:
        """A splitter for one output of `prompt` (the rendered prompt text)."""
        return ReasoningSplitter(self, _REASONING if self.starts_inside(prompt) else _BEFORE)

    def split(self, prompt: str, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is not there."""
        splitter = self.splitter(prompt)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if splitter.reasoned else None), (content if splitter.answered else None)


class ReasoningSplitter:
    """The state of one output's split (see the module docstring)."""

    def __init__(self, parser: ReasoningParser, state: str):
        self.parser = parser
        self.state = state
        self.held = ""  # text not yet decided: a possible tag prefix
        self.reasoned = state == _REASONING  # the output has a reasoning part
        self.answered = False  # ... and a content part (text after the block, or no block)
        self.at_start = True  # nothing of the reasoning emitted yet (a leading tag is dropped)

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is (still) in its reasoning block, or may yet open one."""
        return self.state != _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) decided by `text` and what was held."""
        text, self.held = self.held + text, ""
        reasoning = content = ""
        start, end = self.parser.start, self.parser.end
        while text:
            if self.state == _BEFORE:
                stripped = text.lstrip()
                if stripped.startswith(start):
                    self.state, self.reasoned = _REASONING, True
                    text = stripped[len(start) :]
                elif start.startswith(stripped):  # (empty, or a prefix of the tag)
                    self.held = text
                    return reasoning, content
                else:
                    self.state, self.answered = _CONTENT, True
            elif self.state == _REASONING:
                if self.at_start:  # a start tag the model wrote itself inside the block
                    stripped = text.lstrip()
                    if start.startswith(stripped) and stripped != start:
                        self.held = text
                        return reasoning, content
                    if stripped.startswith(start):
                        text = stripped[len(start) :]
                    self.at_start = False
                    continue
                index = text.find(end)
                if index >= 0:
                    reasoning += text[:index]
                    text = text[index + len(end) :]
                    self.state, self.answered = _CONTENT, True
                    continue
                keep = _partial_suffix(text, end)
                reasoning += text[: len(text) - keep]
                self.held = text[len(text) - keep :]
                return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text, as what it was taken for: the end of the output."""
        held, self.held = self.held, ""
        if self.state == _BEFORE:
            self.state = _CONTENT
            self.answered = self.answered or bool(held)
            return "", held
        if self.state == _REASONING:
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def reasoning_tokens(parser: ReasoningParser, prompt: str, token_ids: list[int], decode) -> int:
    """How many of an output's tokens are its reasoning: up to the one that completes the end
    tag (found by bisection over decoded prefixes), all where the block never closes, none
    where there is no block. `decode(ids) -> str`."""
    reasoning, content = parser.split(prompt, decode(token_ids))
    if reasoning is None:
        return 0
    if content is None:
        return len(token_ids)
    low, high = 0, len(token_ids)  # the content has started after `high` tokens, not `low`
    while high - low > 1:
        middle = (low + high) // 2
        if parser.split(prompt, decode(token_ids[:middle]))[1] is None:
            low = middle
        else:
            high = middle
    return high

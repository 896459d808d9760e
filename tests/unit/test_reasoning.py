"""The reasoning parser (jaxinfer.server.reasoning): whole outputs of each style, and every way
a stream can cut them (a tag split over deltas) giving the whole output's split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxinfer.reasoning import ReasoningParser

QWEN3, R1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # a template that opens the block


@pytest.mark.parametrize(
    "parser, prompt, text, expected",
    [
        # qwen3: a block where the output opens one, else all content
        (QWEN3, "", "<think>plan</think>answer", ("plan", "answer")),
        (QWEN3, "", "\n<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
        (QWEN3, "", "just an answer", (None, "just an answer")),
        (QWEN3, "", "answer with </think> inside", (None, "answer with </think> inside")),
        (QWEN3, "", "<think>cut off", ("cut off", None)),  # never closes: all reasoning
        (QWEN3, "", "<thi", (None, "<thi")),
        (QWEN3, "", "<think>a</think>", ("a", "")),
        # the prompt opened the block: the output starts in it
        (QWEN3, OPEN_PROMPT, "plan</think>answer", ("plan", "answer")),
        (QWEN3, OPEN_PROMPT, "still thinking", ("still thinking", None)),
        (QWEN3, "<think>\n\n</think>\n\n", "answer", (None, "answer")),  # thinking turned off
        # deepseek_r1: in the block from the start, with or without the tag
        (R1, "", "plan</think>answer", ("plan", "answer")),
        (R1, "", "<think>plan</think>answer", ("plan", "answer")),
        (R1, "", "no end tag", ("no end tag", None)),
        (R1, "", "</think>answer", ("", "answer")),
    ],
)
def test_whole_outputs(parser, prompt, text, expected):
    assert parser.split(prompt, text) == expected


def streamed(parser, prompt, pieces):
    splitter = parser.splitter(prompt)
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = splitter.finish() if piece is None else splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    return (
        reasoning if splitter.reasoned else None,
        content if splitter.answered else None,
    )


TEXTS = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "a", "b c", "\n", " "]),
    max_size=12,
).map("".join)


@given(
    parser=st.sampled_from([QWEN3, R1]),
    prompt=st.sampled_from(["", OPEN_PROMPT]),
    text=TEXTS,
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_any_cut_of_a_stream_gives_the_whole_outputs_split(parser, prompt, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert streamed(parser, prompt, pieces) == parser.split(prompt, text)
    assert streamed(parser, prompt, list(text)) == parser.split(prompt, text)  # char by char


def test_a_tag_split_over_deltas_is_held_until_decided():
    splitter = R1.splitter("")
    assert splitter.feed("plan</th") == ("plan", "")  # "</th" held
    assert splitter.feed("ink>ans") == ("", "ans")
    assert splitter.feed("wer") == ("", "wer")
    splitter = QWEN3.splitter("")
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("is is content") == ("", "<this is content")


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ReasoningParser("granite")

"""Tool calling (jaxinfer.server.tool_calls): the parser against every way a stream can be cut,
the prompt a template with or without tools gets, and the server driven with the openai
client: required and named calls validate against their schemas (streamed and not), auto
parses the model's blocks, none leaves the tools out."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from jaxinfer.server import tool_calls
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from jaxinfer.server.formatting import sse
from jaxinfer.tokenizer import TokenizerWrapper
from tests.support.engines import PRESETS, build_engine

pytestmark = pytest.mark.engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A template that reads `tools` and keeps prompts short (the tiny model's tokens are bytes).
COMPACT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
)
AUTO_PLAN = tool_calls.ToolPlan("auto", tuple(TOOLS))


# -- the parser --------------------------------------------------------------------------

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("It is sunny.", "It is sunny.", []),
        (CALL, None, [("get_weather", {"city": "Oslo", "unit": "c"})]),
        (f"Let me look.\n{CALL}", "Let me look.", [("get_weather", {"city": "Oslo", "unit": "c"})]),
        (
            f"{CALL}\n" + CALL.replace("Oslo", "Rome"),
            None,
            [
                ("get_weather", {"city": "Oslo", "unit": "c"}),
                ("get_weather", {"city": "Rome", "unit": "c"}),
            ],
        ),
        (  # SmolLM2's list form
            '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", '
            '"arguments": {"a": 3, "b": 4}}]</tool_call>',
            None,
            [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
        ),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('cut short <tool_call>\n{"name": ', 'cut short <tool_call>\n{"name": ', []),
        ("a < b and <tool_ca", "a < b and <tool_ca", []),
    ],
)
def test_parse_whole_outputs(text, content, calls):
    got_content, got_calls = tool_calls.parse(text, AUTO_PLAN)
    assert got_content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls
    ] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize(
    "text", [f"Let me look.\n{CALL}\n{CALL} done", "a <tool_c b <tool_call", CALL]
)
def test_streams_cut_anywhere_give_the_whole_parse(text):
    """Every cut into two deltas, and one character a delta: the same content and calls."""
    expected = tool_calls.parse(text, AUTO_PLAN)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        stream = tool_calls.CallStream(AUTO_PLAN)
        deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert ((content.strip() if calls else content) or None) == expected[0]
        assert [c["function"] for c in calls] == [c["function"] for c in expected[1]]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" + "[" * 1000,  # unclosed: content
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # nested past json's depth
        '<tool_call>{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
        "<tool_call>" + "{" * 3000 + "</tool_call> and then text",
    ],
)
def test_anything_unparsable_is_text_never_an_error(text):
    """A model's `<tool_call>` and a thousand `[` raised RecursionError: a 500, or a stream
    cut without an error event or [DONE]."""
    content, calls = tool_calls.parse(text, AUTO_PLAN)
    assert calls == [] and content and content.startswith("<tool_call>")
    stream = tool_calls.CallStream(AUTO_PLAN)
    deltas = [d for i in range(0, len(text), 7) for d in stream.feed(text[i : i + 7])]
    deltas += stream.finish()
    assert "".join(d.get("content", "") for d in deltas) == content
    assert not any("tool_calls" in d for d in deltas)


def test_a_conversations_arguments_nested_past_the_parser_stay_text():
    arguments = "[" * 100_000
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": arguments}}],
        }
    ]
    (message,) = tool_calls.conversation_for(messages, None, reads_tools=False)
    assert arguments in message["content"]


def test_a_stream_that_fails_ends_with_an_error_event_and_done():
    async def chunks():
        yield {"n": 1}
        raise RecursionError("maximum recursion depth exceeded")

    async def collect():
        return [event async for event in sse(chunks())]

    events = asyncio.run(collect())
    assert events[0] == 'data: {"n": 1}\n\n'
    assert json.loads(events[1][6:])["error"]["code"] == 500
    assert events[-1] == "data: [DONE]\n\n"


def test_a_named_choice_streams_its_arguments():
    named = tool_calls.ToolPlan("named", tuple(TOOLS), named="add")
    stream = tool_calls.CallStream(named)
    deltas = [
        *stream.feed('{"a": '),
        *stream.feed("1, "),
        *stream.feed('"b": 2}'),
        *stream.finish(),
    ]
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "add" and first["id"].startswith("call_")
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == {"a": 1, "b": 2}


def test_plans_and_their_refusals():
    assert tool_calls.plan(None, None, None) is None
    assert tool_calls.plan(TOOLS, None, None).mode == "auto"
    assert tool_calls.plan(TOOLS, "none", None).rendered_tools is None
    named = tool_calls.plan(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert named.mode == "named" and named.constraint().json == SCHEMAS["add"]
    assert "%json" in tool_calls.plan(TOOLS, "required", False).constraint().grammar
    with pytest.raises(ValueError, match="needs tools"):
        tool_calls.plan(None, "required", None)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_calls.plan(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ValueError, match="unique"):
        tool_calls.plan([ADD, ADD], "auto", None)


# -- prompts -----------------------------------------------------------------------------


def test_templates_with_and_without_tools(tiny_model_dir):
    tokenizer = TokenizerWrapper(tiny_model_dir)
    assert not tool_calls.template_reads_tools(tokenizer.chat_template)
    assert tool_calls.template_reads_tools(COMPACT)
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    flat = tool_calls.conversation_for(history, [WEATHER], reads_tools=False)
    assert flat[0]["role"] == "system" and '"name":"get_weather"' in flat[0]["content"]
    assert flat[2]["content"].startswith("<tool_call>\n") and "Oslo" in flat[2]["content"]
    assert flat[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    text = tokenizer.apply_chat_template(flat)
    assert "<tools>" in text and "<tool_response>" in text
    assert tool_calls.conversation_for(history, [WEATHER], reads_tools=True) is history


# -- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    options = {**PRESETS["served"], "max_model_len": 512}
    engine = AsyncEngine(build_engine(tiny_model_dir, None, **options))
    config = ServerConfig(served_model_name="tiny", allow_request_chat_template=True)
    url, server = serve(build_app(engine, config))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    server.should_exit = True


def ask(client, tool_choice, stream=False, **extra):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Oslo, or 2 + 3?"}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=1.0,
        seed=extra.pop("seed", 0),
        stream=stream,
        extra_body={"chat_template": COMPACT, **extra.pop("extra_body", {})},
        **extra,
    )


def gathered(chunks) -> tuple[str, list[dict], str]:
    """(content, calls, finish reason) of a streamed answer, its deltas put together."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function.name:
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_validate_against_their_schemas(client, seed):
    answer = ask(client, "required", seed=seed, parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    valid(call.function.name, call.function.arguments)
    _, calls, finish = gathered(ask(client, "required", True, seed=seed, parallel_tool_calls=False))
    assert finish == "tool_calls" and len(calls) == 1
    valid(calls[0]["name"], calls[0]["arguments"])
    assert calls[0] == {"name": call.function.name, "arguments": call.function.arguments}


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_function_is_called_with_valid_arguments(client, name):
    choice_param = {"type": "function", "function": {"name": name}}
    choice = ask(client, choice_param).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == name
    valid(name, call.function.arguments)
    _, calls, finish = gathered(ask(client, choice_param, True))
    assert finish == "stop" and [c["name"] for c in calls] == [name]
    assert calls[0]["arguments"] == call.function.arguments


def test_auto_parses_the_models_own_blocks(client):
    """The model is random, so a grammar makes it write a block; auto parses it, streamed and
    not."""
    said = 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    extra_body = {"structured_outputs": {"choice": [said]}}
    choice = ask(client, "auto", extra_body=extra_body).choices[0]
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    content, calls, finish = gathered(ask(client, "auto", True, extra_body=extra_body))
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert calls == [{"name": "add", "arguments": call.function.arguments}]


def test_the_tools_reach_the_prompt_unless_none(client):
    """The tiny model's template does not read tools: they come as a system message (more
    prompt tokens) under auto, and not at all under none."""

    def prompt_tokens(**tools):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, **tools
        ).usage.prompt_tokens

    bare = prompt_tokens()
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == bare
    assert prompt_tokens(tools=[WEATHER]) > bare + len(json.dumps(WEATHER["function"])) // 2


def test_tool_requests_that_cannot_be_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tool_choice="required"
        )
    with pytest.raises(openai.BadRequestError, match="constrains the output"):
        ask(client, "required", response_format={"type": "json_object"})

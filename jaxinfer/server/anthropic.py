"""Anthropic's Messages API (POST /v1/messages) on the chat path: the request translated
(anthropic_protocol), admitted by OpenAIServing.start_chat, its output's parts (reasoning,
text, tool calls: chat_output) as Anthropic's content blocks, whole or as its stream of events
(message_start, content_block_start / delta / stop, message_delta, message_stop)."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator

import fastapi

from jaxinfer.server.anthropic_protocol import MessagesRequest
from jaxinfer.server.errors import APIError, anthropic_error_body
from jaxinfer.server.formatting import json_response, sse
from jaxinfer.server.serving import BAD_REQUEST, ChatStart, OpenAIServing
from jaxinfer.server.streams import answer

# Anthropic's server-sent events: named by type, no [DONE], errors in its shape.
ANTHROPIC_SSE = functools.partial(
    sse,
    named=True,
    error=lambda status, message, kind: anthropic_error_body(status, message),
    done=False,
)


class AnthropicServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def messages(self, body: MessagesRequest):
        serving = self.serving
        try:
            chat = body.chat_request(reasoning=serving.reasoning is not None)
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None
        start = await serving.start_chat(chat)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"

        def build(final) -> fastapi.Response:
            (c,) = final.outputs
            parts, _ = serving.whole_choice(start, c)
            if body.omits_thinking and parts[0] is not None:
                parts = ("", *parts[1:])
            message = self._message(message_id, parts, c)
            message["usage"] = {
                "input_tokens": len(final.prompt_token_ids),
                "output_tokens": len(c.token_ids),
            }
            return json_response(message)

        events = self._events(start, message_id, body.omits_thinking) if body.stream else None
        return await answer(serving.engine, start, events, ANTHROPIC_SSE, build)

    def _message(self, message_id: str, parts, c) -> dict:
        thought, content, calls = parts
        blocks = []
        if thought is not None:
            blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        for call in calls:
            blocks.append(tool_use_block(call))
        stop_reason, stop_sequence = stop_of(c, bool(calls))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.served_model_name,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
        }

    async def _events(
        self, start: ChatStart, message_id: str, omit_thinking: bool
    ) -> AsyncIterator[dict]:
        parser = self.serving.choice_parser(start)
        blocks = _Blocks(omit_thinking)
        output_tokens, started = 0, False
        stop_reason, stop_sequence = "end_turn", None
        async for output in start.held.streams[0]:
            if not started:  # the prompt's size is known with the first output
                started = True
                message = self._message(message_id, (None, None, []), None)
                message["stop_reason"] = message["stop_sequence"] = None
                usage = {"input_tokens": len(output.prompt_token_ids), "output_tokens": 0}
                yield {"type": "message_start", "message": {**message, "usage": usage}}
            for c in output.outputs:
                output_tokens += len(c.token_ids)
                final = c.finish_reason is not None
                if not c.text and not final:
                    continue
                for delta in parser.feed(c.text, final=final):
                    for event in blocks.events(delta):
                        yield event
                if final:
                    stop_reason, stop_sequence = stop_of(c, parser.called)
        for event in blocks.close():
            yield event
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        }
        yield {"type": "message_stop"}


class _Blocks:
    """The stream's content blocks: each chat delta continues the open block of its kind or
    closes it and opens the next (a tool call is a block of its own, its arguments streamed
    as input_json_delta)."""

    def __init__(self, omit_thinking: bool):
        self.index = -1
        self.kind: str | None = None  # of the open block
        self.omit_thinking = omit_thinking  # thinking blocks opened, their text left out

    def _open(self, kind: str, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return [
            *events,
            {"type": "content_block_start", "index": self.index, "content_block": block},
        ]

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def events(self, delta: dict) -> list[dict]:
        events = []
        if "reasoning_content" in delta:
            if self.kind != "thinking":
                events += self._open(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            )
        if "content" in delta:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call (a named one's arguments follow in later deltas)
                block = {**tool_use_block(call, parse=False), "input": {}}
                events += self._open("tool_use", block)
            arguments = call["function"].get("arguments", "")
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events


def tool_use_block(call: dict, parse: bool = True) -> dict:
    """A chat tool call as a tool_use block (its arguments parsed, where `parse`)."""
    arguments = call["function"].get("arguments") or "{}"
    block = {
        "type": "tool_use",
        "id": call["id"].replace("call_", "toolu_", 1),
        "name": call["function"]["name"],
    }
    if parse:
        try:
            block["input"] = json.loads(arguments)
        except json.JSONDecodeError:  # cut short (max_tokens): what there is, as a string
            block["input"] = {"_unparsed_arguments": arguments}
    return block


def stop_of(c, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c is None:
        return "end_turn", None
    if called and c.finish_reason == "stop":
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None

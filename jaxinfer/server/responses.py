"""OpenAI's Responses API (POST /v1/responses) on the chat path: the request translated
(responses_protocol), admitted by OpenAIServing.start_chat, its output's parts (reasoning,
text, function calls: chat_output) as output items, whole or as the typed stream of events
(response.created, response.output_item.added, response.output_text.delta,
response.function_call_arguments.delta, ..., response.completed). Responses are kept in a
bounded in-memory store (oldest evicted) for `previous_response_id`, unless `store` is false.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator

import fastapi

from jaxinfer.server.errors import APIError
from jaxinfer.server.formatting import json_response, sse
from jaxinfer.server.responses_protocol import ResponsesRequest
from jaxinfer.server.serving import BAD_REQUEST, ChatStart, OpenAIServing
from jaxinfer.server.streams import answer

MAX_STORED = 1024
NAMED_SSE = functools.partial(
    sse, named=True, done=False
)  # events named by type, no [DONE]  # responses kept for previous_response_id, oldest evicted first


@dataclasses.dataclass
class Stored:
    body: dict  # the response as returned
    conversation: list[dict]  # its chat messages, input and output, for a later response


class ResponseStore:
    """The last `max_entries` stored responses, by id (thread-safe)."""

    def __init__(self, max_entries: int = MAX_STORED):
        self.max_entries = max_entries
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: Stored) -> None:
        with self._lock:
            self._items[response_id] = stored
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        with self._lock:
            stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"response {response_id!r} not found (never stored, or evicted: the server keeps "
                f"the last {self.max_entries})",
                "not_found_error",
            )
        return stored


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None):
        self.serving = serving
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id).body

    async def create(self, body: ResponsesRequest):
        serving = self.serving
        history = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id).conversation
        try:
            chat = body.chat_request(history, reasoning=serving.reasoning is not None)
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None
        start = await serving.start_chat(chat)
        frame = self._frame(body, _id("resp"))

        def build(final) -> fastapi.Response:
            (c,) = final.outputs
            parts, thought_tokens = serving.whole_choice(start, c)
            tokens = len(final.prompt_token_ids), len(c.token_ids)
            items = output_items(parts)
            done = self._finish(frame, body, chat, items, c.finish_reason, tokens, thought_tokens)
            return json_response(done)

        events = numbered(self._events(start, body, chat, frame)) if body.stream else None
        return await answer(serving.engine, start, events, NAMED_SSE, build)

    def _frame(self, body: ResponsesRequest, response_id: str) -> dict:
        """The response's fields that do not depend on its output."""
        choice = body.tool_choice
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.serving.served_model_name,
            "output": [],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice.model_dump()
            if hasattr(choice, "model_dump")
            else choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": body.text.model_dump(by_alias=True)
            if body.text
            else {"format": {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "metadata": body.metadata or {},
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    def _finish(self, frame, body, chat, items, finish_reason, tokens, thought_tokens) -> dict:
        """The completed response (stored unless `store` is false); `tokens`: (prompt, output)."""
        cut = finish_reason == "length"
        prompt_tokens, output_tokens = tokens
        done = {
            **frame,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": items,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": thought_tokens},
                "total_tokens": prompt_tokens + output_tokens,
            },
        }
        if body.store:
            conversation = [m.model_dump(exclude_none=True) for m in chat.messages]
            if body.instructions is not None:  # (they do not carry over)
                conversation = conversation[1:]
            conversation += answer_messages(items)
            self.store.put(frame["id"], Stored(done, conversation))
        return done

    async def _events(
        self, start: ChatStart, body: ResponsesRequest, chat, frame: dict
    ) -> AsyncIterator[dict]:
        parser = self.serving.choice_parser(start)
        items = _Items()
        yield {"type": "response.created", "response": frame}
        yield {"type": "response.in_progress", "response": frame}
        thought_tokens = prompt_tokens = output_tokens = 0
        finish_reason = None
        async for output in start.held.streams[0]:
            prompt_tokens = len(output.prompt_token_ids)
            for c in output.outputs:
                output_tokens += len(c.token_ids)
                if parser.in_reasoning:
                    thought_tokens += len(c.token_ids)
                is_last = c.finish_reason is not None
                if c.text or is_last:
                    for delta in parser.feed(c.text, final=is_last):
                        for event in items.events(delta):
                            yield event
                if is_last:
                    finish_reason = c.finish_reason
        for event in items.close():
            yield event
        tokens = prompt_tokens, output_tokens
        done = self._finish(frame, body, chat, items.done, finish_reason, tokens, thought_tokens)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield {"type": kind, "response": done}


def output_items(parts) -> list[dict]:
    """(reasoning, content, tool calls) as output items."""
    thought, content, calls = parts
    items = []
    if thought is not None:
        items.append(reasoning_item(_id("rs"), thought))
    if content:
        items.append(message_item(_id("msg"), content, "completed"))
    for call in calls:
        items.append(call_item(_id("fc"), call, "completed"))
    return items


def reasoning_item(item_id: str, text: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments", ""),
        "status": status,
    }


def answer_messages(items: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later response continues from (its
    reasoning left out, as the reasoning models' templates leave it)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items
        if i["type"] == "function_call"
    ]  # fmt: skip
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message] if text or calls else []


class _Items:
    """The stream's output items: each chat delta continues the open item of its kind or
    closes it and opens the next (each function call an item of its own)."""

    def __init__(self):
        self.done: list[dict] = []  # closed items, in output order
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text (reasoning, message) or arguments (function call)
        self.output_tokens = 0

    @property
    def index(self) -> int:
        return len(self.done)

    def _start(self, item: dict) -> list[dict]:
        events = self.close()
        self.open, self.text = item, ""
        events.append(
            {"type": "response.output_item.added", "output_index": self.index, "item": item}
        )
        if item["type"] == "message":
            events.append(self._part("response.content_part.added", output_text("")))
        return events

    def _part(self, kind: str, part: dict) -> dict:
        return {
            "type": kind,
            "item_id": self.open["id"],
            "output_index": self.index,
            "content_index": 0,
            "part": part,
        }

    def close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "message":
            item = message_item(item["id"], self.text, "completed")
            events = [
                {"type": "response.output_text.done", **where, "content_index": 0, "text": self.text, "logprobs": []},
                self._part("response.content_part.done", output_text(self.text)),
            ]  # fmt: skip
        elif item["type"] == "reasoning":
            item = reasoning_item(item["id"], self.text)
            events = [
                {
                    "type": "response.reasoning_text.done",
                    **where,
                    "content_index": 0,
                    "text": self.text,
                }
            ]
        else:
            item = {**item, "arguments": self.text, "status": "completed"}
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": self.text,
                       "name": item["name"]}]  # fmt: skip
        events.append(
            {"type": "response.output_item.done", "output_index": self.index, "item": item}
        )
        self.done.append(item)
        self.open = None
        return events

    def events(self, delta: dict) -> list[dict]:
        events = []
        kind = self.open["type"] if self.open else None
        if "reasoning_content" in delta:
            if kind != "reasoning":
                events += self._start(
                    {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
                )
            text = delta["reasoning_content"]
            self.text += text
            events.append({"type": "response.reasoning_text.delta", "item_id": self.open["id"],
                           "output_index": self.index, "content_index": 0, "delta": text})  # fmt: skip
        if "content" in delta:
            if kind != "message":
                events += self._start(message_item(_id("msg"), None, "in_progress"))
            text = delta["content"]
            self.text += text
            events.append({"type": "response.output_text.delta", "item_id": self.open["id"],
                           "output_index": self.index, "content_index": 0, "delta": text,
                           "logprobs": []})  # fmt: skip
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call (a named one's arguments follow in later deltas)
                events += self._start(call_item(_id("fc"), {**call, "function": {**call["function"], "arguments": ""}}, "in_progress"))  # fmt: skip
            arguments = call["function"].get("arguments", "")
            if arguments:
                self.text += arguments
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": self.open["id"], "output_index": self.index,
                               "delta": arguments})  # fmt: skip
        return events


async def numbered(events: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The Responses stream's events, each with its sequence number."""
    number = 0
    async for event in events:
        yield {**event, "sequence_number": number}
        number += 1

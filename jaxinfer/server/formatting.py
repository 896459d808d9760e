"""Engine outputs as OpenAI response bodies and stream chunks (completions and chat)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import fastapi

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.async_engine import EngineDeadError
from jaxinfer.server.errors import error_body
from jaxinfer.server.tool_calls import ToolPlan
from jaxinfer.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)


class Formatter:
    """Args:
    tokenizer: turns token ids into the text of logprob entries.
    model: the served model name every body carries.
    """

    def __init__(self, tokenizer: TokenizerWrapper, model: str):
        self.tokenizer = tokenizer
        self.model = model
        self._texts: dict[int, str] = {}  # token id -> its text (at most the vocabulary)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def completion_logprobs(self, token_ids, logprobs) -> dict:
        return {
            "tokens": [self.token_text(t) for t in token_ids],
            "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
            "top_logprobs": [{self.token_text(k): v for k, v in lp.items()} for lp in logprobs],
        }

    def chat_logprobs(self, token_ids, logprobs) -> list[dict]:
        def entry(token_id, value):
            text = self.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return [
            {
                **entry(t, lp[t]),
                "top_logprobs": [entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])],
            }
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]

    def prompt_logprobs(self, prompt_logprobs) -> list[dict | None] | None:
        """vLLM's shape: per prompt token (None for the first), token id -> logprob and text."""
        if prompt_logprobs is None:
            return None
        return [
            None
            if top is None
            else {
                str(token): {"logprob": value, "decoded_token": self.token_text(token)}
                for token, value in top.items()
            }
            for top in prompt_logprobs
        ]

    def completion_choice(
        self, index: int, c: CompletionOutput, with_logprobs: bool, prompt_logprobs=None
    ) -> dict:
        """`prompt_logprobs`: formatted (`prompt_logprobs()`), or None."""
        choice = {
            "index": index,
            "text": c.text,
            "logprobs": self.completion_logprobs(c.token_ids, c.logprobs)
            if with_logprobs
            else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def chat_choice(
        self,
        c: CompletionOutput,
        with_logprobs: bool,
        tool_plan: ToolPlan | None,
        parts: tuple[str | None, str | None, list[dict]],
        with_reasoning: bool,
    ) -> dict:
        """A whole answer from its (reasoning, content, tool calls): chat_output.whole."""
        reasoning, content, calls = parts
        message: dict = {"role": "assistant", "content": content}
        if with_reasoning:
            message["reasoning_content"] = reasoning
        finish_reason = c.finish_reason
        if calls:
            message["tool_calls"] = calls
            finish_reason = tool_finish_reason(finish_reason, tool_plan)
        return {
            "index": c.index,
            "message": message,
            "logprobs": {"content": self.chat_logprobs(c.token_ids, c.logprobs)}
            if with_logprobs
            else None,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }

    def body(self, request_id: str, created: int, kind: str, choices: list, **extra) -> dict:
        return {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def tool_finish_reason(finish_reason: str | None, tool_plan: ToolPlan) -> str | None:
    """OpenAI's: an answer that ends in calls it chose (auto, required) is "tool_calls"; a
    named function's call ends as "stop"."""
    if finish_reason == "stop" and tool_plan.mode != "named":
        return "tool_calls"
    return finish_reason


def json_response(body: dict) -> fastapi.Response:
    """A body serialized once, where it was built (a worker thread for large ones)."""
    return fastapi.Response(json.dumps(body).encode(), media_type="application/json")


class Usage:
    """Token counts of one request, added up as its outputs arrive (deltas or finals)."""

    def __init__(self, reasoning: bool = False):
        """`reasoning`: the server parses reasoning, so the body counts its tokens too
        (`reasoning_tokens`, added by the caller)."""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens: int | None = 0 if reasoning else None
        self._prompts: set[str] = set()

    def add(self, output: RequestOutput) -> None:
        if output.request_id not in self._prompts:
            self._prompts.add(output.request_id)
            self.prompt_tokens += len(output.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def body(self) -> dict:
        body = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.reasoning_tokens is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body


async def sse(
    chunks: AsyncIterator[dict], named: bool = False, error=error_body, done: bool = True
) -> AsyncIterator[str]:
    """Server-sent events, ending in [DONE] where `done` (OpenAI's chat and completions): an
    engine that dies mid-stream, or any other failure, is an error event first, its body
    `error(status, message, kind)` (a client that left gets nothing more). `named`: each
    event has an `event:` line naming its type (Anthropic's and the Responses API's)."""

    def frame(body: dict) -> str:
        data = f"data: {json.dumps(body)}\n\n"
        return f"event: {body.get('type') or 'error'}\n{data}" if named else data

    try:
        async for chunk in chunks:
            yield frame(chunk)
    except EngineDeadError as failure:
        yield frame(error(503, str(failure), "engine_dead"))
    except Exception:
        logger.exception("a stream failed")
        yield frame(error(500, "the server failed to continue this stream", "server_error"))
    if done:
        yield "data: [DONE]\n\n"

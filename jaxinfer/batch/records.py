"""The OpenAI Batch file formats: input lines in, result records out.

Input, one JSON object per line: {"custom_id", "method": "POST", "url", "body"}.
Output, one record per input line: {"id", "custom_id", "response", "error"}, where
`response` is {"status_code", "request_id", "body"} for every request the API answered
(errors included, with the server's error body) and `error` is {"code", "message"} for a
line that never reached the API (malformed JSON, an unknown url, a duplicate custom_id).
A record of a line without a usable custom_id carries its 1-based `line` in `error`, so a
resumed run can still tell that line is done.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions")


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One input line that can be sent to the API."""

    line: int  # 1-based
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LineError:
    """One input line that cannot be sent, and why."""

    line: int
    custom_id: str | None
    code: str
    message: str


def parse_line(line_number: int, text: str) -> BatchItem | LineError:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        return LineError(line_number, None, "invalid_json", f"line {line_number}: {error}")
    if not isinstance(obj, dict):
        return LineError(
            line_number, None, "invalid_request", f"line {line_number}: not a JSON object"
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            line_number, None, "invalid_request", f"line {line_number}: needs a custom_id string"
        )

    def refuse(code: str, message: str) -> LineError:
        return LineError(line_number, custom_id, code, f"line {line_number}: {message}")

    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return refuse("invalid_request", f"unknown fields {unknown}")
    if obj.get("method") != "POST":
        return refuse("invalid_method", f"method must be POST, not {obj.get('method')!r}")
    if obj.get("url") not in URLS:
        return refuse("invalid_url", f"url must be one of {list(URLS)}, not {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return refuse("invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return refuse("invalid_request", "stream is not supported in batch runs")
    return BatchItem(line_number, custom_id, obj["url"], body)


def parse_lines(lines: list[str]) -> list[BatchItem | LineError]:
    """Parses every non-blank line."""
    return [parse_line(n, text) for n, text in enumerate(lines, start=1) if text.strip()]


def refuse_duplicates(items: list[BatchItem | LineError]) -> list[BatchItem | LineError]:
    """A custom_id seen on an earlier line makes the later line an error."""
    seen: set[str] = set()
    checked: list[BatchItem | LineError] = []
    for item in items:
        if isinstance(item, BatchItem):
            if item.custom_id in seen:
                message = (
                    f"line {item.line}: custom_id {item.custom_id!r} appears on an earlier line"
                )
                item = LineError(item.line, item.custom_id, "duplicate_custom_id", message)
            else:
                seen.add(item.custom_id)
        checked.append(item)
    return checked


def response_record(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }


def error_record(error: LineError) -> dict[str, Any]:
    details: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.custom_id is None:
        details["line"] = error.line
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": error.custom_id,
        "response": None,
        "error": details,
    }


def is_done(item: BatchItem | LineError, done_ids: set[str], done_lines: set[int]) -> bool:
    if item.custom_id is not None:
        return item.custom_id in done_ids
    return item.line in done_lines


def record_keys(records: list[dict[str, Any]]) -> tuple[set[str], set[int]]:
    """The custom_ids and (for records without one) input lines the records answer."""
    ids, lines = set(), set()
    for record in records:
        if record.get("custom_id") is not None:
            ids.add(record["custom_id"])
        elif isinstance(record.get("error"), dict) and "line" in record["error"]:
            lines.add(record["error"]["line"])
    return ids, lines

"""Quick runs from a prompts file: each prompt becomes one batch item.

A `.jsonl` file has one JSON object per line with a `prompt` string, an optional `custom_id`
and any other request-body fields (they override the sampling flags for that line); any
other file is plain text, one prompt per non-blank line. Items without a custom_id get
`prompt-<line>`, so a resumed run over the same file skips what is done.
"""

from __future__ import annotations

import json
from typing import Any

from jaxinfer.batch.records import BatchItem, LineError

FORMATS = ("chat", "completion")


def prompt_items(
    lines: list[str], jsonl: bool, prompt_format: str, sampling: dict[str, Any]
) -> list[BatchItem | LineError]:
    if prompt_format not in FORMATS:
        raise ValueError(f"prompt_format must be one of {FORMATS}, not {prompt_format!r}")
    items: list[BatchItem | LineError] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        custom_id = f"prompt-{number}"
        extra: dict[str, Any] = {}
        if jsonl:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as error:
                items.append(LineError(number, None, "invalid_json", f"line {number}: {error}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                items.append(
                    LineError(
                        number, None, "invalid_request", f"line {number}: needs a prompt string"
                    )
                )
                continue
            extra = dict(obj)
            prompt = extra.pop("prompt")
            custom_id = str(extra.pop("custom_id", custom_id))
        else:
            prompt = text.rstrip("\r\n")
        if prompt_format == "chat":
            url = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": prompt}]}
        else:
            url = "/v1/completions"
            body = {"prompt": prompt}
        items.append(BatchItem(number, custom_id, url, {**body, **sampling, **extra}))
    return items

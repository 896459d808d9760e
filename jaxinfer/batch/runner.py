"""Sends batch lines through the server's own request handling, all at once.

Each line is posted to the FastAPI app in process (httpx's ASGI transport: no socket), so a
result body is exactly what the server answers for that body, errors included. Every line is
in flight together and the engine's continuous batching packs them into its steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import fastapi
import httpx
from tqdm.auto import tqdm

from jaxinfer.batch.output_file import usage_of
from jaxinfer.batch.records import BatchItem, LineError, error_record, response_record
from jaxinfer.server.request_ids import MAX_CLIENT_ID


@dataclasses.dataclass(frozen=True)
class RunResult:
    records: list[dict[str, Any]]  # this run's, in the order they were written
    unanswered: int  # lines left without a record because the engine stopped
    wall_seconds: float


async def run_items(
    app: fastapi.FastAPI,
    items: Sequence[BatchItem | LineError],
    write: Callable[[dict[str, Any]], None],
    engine_alive: Callable[[], bool],
    show_progress: bool = True,
    random_seed: int | None = None,
) -> RunResult:
    """Answers every item, calling `write` with each record as it completes.

    If the engine loop dies, the lines it could not answer get no record (a later --resume
    runs them) rather than a server error recorded as their result.

    random_seed: when set, a line whose body sets no seed samples with one derived from this
    and its custom_id (line_seed), so a rerun or a resume draws the same tokens; unset, such
    lines are random as on the server.
    """
    records: list[dict[str, Any]] = []
    unanswered = 0
    generated = 0
    start = time.perf_counter()
    bar = tqdm(total=len(items), unit="req", disable=not show_progress, desc="batch")

    def finish(record: dict[str, Any]) -> None:
        nonlocal generated
        write(record)
        records.append(record)
        generated += usage_of(record)[1]
        bar.update(1)
        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as c:

        async def answer(item: BatchItem) -> None:
            nonlocal unanswered
            # The line's custom_id labels its response.
            headers = {"X-Request-Id": line_request_id(item.custom_id)}
            body = item.body
            if random_seed is not None and isinstance(body, dict) and body.get("seed") is None:
                body = {**body, "seed": line_seed(random_seed, item.custom_id)}
            response = await c.post(item.url, json=body, headers=headers)
            try:
                body = response.json()
            except json.JSONDecodeError:
                body = response.text
            if response.status_code >= 500 and not engine_alive():
                unanswered += 1
                return
            finish(response_record(item.custom_id, response.status_code, body))

        tasks = []
        for item in items:
            if isinstance(item, LineError):
                finish(error_record(item))
            else:
                tasks.append(asyncio.ensure_future(answer(item)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
    return RunResult(records, unanswered, time.perf_counter() - start)


def line_request_id(custom_id: str) -> str:
    """The X-Request-Id of a line: its custom_id, or a digest of one the server would refuse
    as an id (too long, unprintable)."""
    if 0 < len(custom_id) <= MAX_CLIENT_ID and custom_id.isprintable():
        return custom_id
    return hashlib.sha256(custom_id.encode()).hexdigest()


def line_seed(random_seed: int, custom_id: str) -> int:
    """The seed of a line that sets none, under run_batch's --random_seed (63 bits)."""
    digest = hashlib.blake2b(f"{random_seed}/{custom_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

"""The results file: records appended and flushed one by one, a summary written last.

The summary file (`<output>.summary.json` unless named) is written with an atomic rename
when every line has a record, and removed when a run starts, so a results file whose summary
is missing is a partial one. A resumed run drops a half-written last line (an interrupted
write) and keeps every complete record.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any


def summary_path_for(output: Path) -> Path:
    return output.with_name(output.name + ".summary.json")


def refuse_existing(output: Path, *, resume: bool, overwrite: bool) -> None:
    if output.exists() and not (resume or overwrite):
        raise FileExistsError(
            f"{output} exists: pass --resume to continue it or --overwrite to replace it"
        )


def open_results(output: Path, summary: Path, *, resume: bool, overwrite: bool):
    """Returns (the records already there, a file to append to, the path the records go to).

    With `overwrite`, records go to `<output>.partial`, renamed over `output` by
    `commit_results` when the run ends: an interrupted run leaves the old results intact.
    """
    refuse_existing(output, resume=resume, overwrite=overwrite)
    summary.unlink(missing_ok=True)
    records: list[dict[str, Any]] = []
    if resume and output.exists():
        data = output.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]  # an interrupted write leaves a partial line
        if len(complete) != len(data):
            with output.open("r+b") as f:
                f.truncate(len(complete))
        for number, line in enumerate(complete.decode().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{output} line {number} is not a result record: {error}"
                ) from None
        return records, output.open("a", encoding="utf-8"), output
    output.parent.mkdir(parents=True, exist_ok=True)
    path = partial_path_for(output) if overwrite and output.exists() else output
    return records, path.open("w", encoding="utf-8"), path


def partial_path_for(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def commit_results(written: Path, output: Path) -> None:
    """Puts the records written to `written` (open_results') in place as `output`."""
    if written != output:
        os.replace(written, output)


def append_record(handle, record: dict[str, Any]) -> None:
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()


@dataclasses.dataclass(frozen=True)
class BatchSummary:
    """Counts over every record of the results file; times and rates of this run only."""

    requests: int
    succeeded: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    run_requests: int  # lines answered by this run (a resumed run skips the others)
    run_completion_tokens: int
    wall_seconds: float
    requests_per_second: float
    output_tokens_per_second: float

    def describe(self) -> str:
        return (
            f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed; "
            f"{self.prompt_tokens} prompt and {self.completion_tokens} generated tokens. "
            f"This run: {self.run_requests} requests in {self.wall_seconds:.1f} s, "
            f"{self.requests_per_second:.2f} requests/s, "
            f"{self.output_tokens_per_second:.1f} generated tokens/s"
        )


def usage_of(record: dict[str, Any]) -> tuple[int, int]:
    response = record.get("response") or {}
    body = response.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def summarize(
    records: list[dict[str, Any]], run_records: list[dict[str, Any]], wall_seconds: float
) -> BatchSummary:
    succeeded = sum(1 for r in records if (r.get("response") or {}).get("status_code") == 200)
    prompt = sum(usage_of(r)[0] for r in records)
    completion = sum(usage_of(r)[1] for r in records)
    run_completion = sum(usage_of(r)[1] for r in run_records)
    wall = max(wall_seconds, 1e-9)
    return BatchSummary(
        requests=len(records),
        succeeded=succeeded,
        failed=len(records) - succeeded,
        prompt_tokens=prompt,
        completion_tokens=completion,
        run_requests=len(run_records),
        run_completion_tokens=run_completion,
        wall_seconds=wall_seconds,
        requests_per_second=len(run_records) / wall,
        output_tokens_per_second=run_completion / wall,
    )


def write_summary(path: Path, summary: BatchSummary) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
    os.replace(temporary, path)

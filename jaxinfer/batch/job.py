"""One batch run: read the lines, skip what a resumed results file holds, answer the rest,
write the summary."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from jaxinfer.batch.output_file import (
    BatchSummary,
    append_record,
    commit_results,
    open_results,
    refuse_existing,
    summarize,
    summary_path_for,
    write_summary,
)
from jaxinfer.batch.prompts import prompt_items
from jaxinfer.batch.records import is_done, parse_lines, record_keys, refuse_duplicates
from jaxinfer.batch.runner import run_items
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine


@dataclasses.dataclass(frozen=True)
class BatchJobConfig:
    """Args:
    output: the results file (OpenAI Batch output format).
    input: an OpenAI Batch input file; or else
    prompts_file: plain text (one prompt per line) or `.jsonl` with a `prompt` field,
        sent as `prompt_format` ("chat" or "completion") requests with `sampling` fields.
    summary: where the summary goes; default `<output>.summary.json`.
    resume: keep the records already in `output` and answer only the other lines.
    overwrite: replace an existing `output` when the run ends (its records go to
        `<output>.partial` until then, so an interrupted run leaves the old results); without
        it or `resume`, an existing `output` is an error.
    random_seed: lines that set no seed sample with one derived from this and their
        custom_id, the same on a rerun or a resume (run_batch's --random_seed); None: they
        are random.
    """

    output: Path
    input: Path | None = None
    prompts_file: Path | None = None
    prompt_format: str = "chat"
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: Path | None = None
    resume: bool = False
    overwrite: bool = False
    show_progress: bool = True
    random_seed: int | None = None

    def __post_init__(self):
        if (self.input is None) == (self.prompts_file is None):
            raise ValueError("give exactly one of --input and --prompts_file")
        if self.sampling and self.input is not None:
            raise ValueError(
                f"sampling flags {sorted(self.sampling)} apply to --prompts_file only; "
                "an --input line sets them in its body"
            )
        if self.resume and self.overwrite:
            raise ValueError("give --resume or --overwrite, not both")

    @property
    def summary_path(self) -> Path:
        return self.summary or summary_path_for(self.output)


class BatchIncompleteError(RuntimeError):
    pass


def check_paths(config: BatchJobConfig) -> None:
    """The file errors a run would meet, before the engine loads."""
    source = config.input or config.prompts_file
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist")
    refuse_existing(config.output, resume=config.resume, overwrite=config.overwrite)


def read_items(config: BatchJobConfig):
    if config.input is not None:
        items = parse_lines(config.input.read_text(encoding="utf-8").splitlines())
    else:
        path = config.prompts_file
        items = prompt_items(
            path.read_text(encoding="utf-8").splitlines(),
            jsonl=path.suffix == ".jsonl",
            prompt_format=config.prompt_format,
            sampling=config.sampling,
        )
    return refuse_duplicates(items)


def run_job(config: BatchJobConfig, engine: AsyncEngine, served_model_name: str) -> BatchSummary:
    """Runs the batch; raises BatchIncompleteError (after writing every record it could) if
    the engine stopped before answering every line."""
    items = read_items(config)
    previous, handle, written = open_results(
        config.output, config.summary_path, resume=config.resume, overwrite=config.overwrite
    )
    done_ids, done_lines = record_keys(previous)
    todo = [item for item in items if not is_done(item, done_ids, done_lines)]
    app = build_app(engine, ServerConfig(served_model_name=served_model_name))
    try:
        result = asyncio.run(
            run_items(
                app,
                todo,
                lambda record: append_record(handle, record),
                lambda: engine.alive,
                config.show_progress,
                config.random_seed,
            )
        )
    finally:
        handle.close()
    commit_results(written, config.output)  # (only an interrupted run leaves the old one)
    if result.unanswered:
        raise BatchIncompleteError(
            f"the engine stopped ({engine.error!r}); {result.unanswered} lines have no record: "
            "rerun with --resume to answer them"
        )
    summary = summarize(previous + result.records, result.records, result.wall_seconds)
    write_summary(config.summary_path, summary)
    return summary

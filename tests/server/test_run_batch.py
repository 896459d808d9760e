"""python -m jaxinfer.run_batch on a tiny model: bad lines, resume after a kill, and results
equal to the server's answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from jaxinfer.batch.job import BatchJobConfig, run_job
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.batch import assert_same, line, read_records
from tests.support.engines import PRESETS, build_engine

pytestmark = pytest.mark.engine

OPTIONS = PRESETS["served"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return AsyncEngine(build_engine(tiny_model_dir, None, **OPTIONS))


def chat(content, **extra):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def good_lines(count, max_tokens=12):
    return [
        line(
            f"req-{i}",
            "/v1/chat/completions" if i % 2 else "/v1/completions",
            chat(f"Tell me about fox number {i}.", max_tokens=max_tokens)
            if i % 2
            else {"prompt": f"The quick brown fox {i}", "max_tokens": max_tokens, "temperature": 0},
        )
        for i in range(count)
    ]


def strip_ids(body):
    """A response body without what differs between two answers (ids, times)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_bad_lines_get_error_records_and_the_others_complete(engine, tmp_path):
    lines = [
        *good_lines(3),
        "{not json",
        line("bad-url", "/v1/embeddings", {"input": "x"}),
        line("bad-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
        line("bad-field", "/v1/chat/completions", chat("hi", frobnicate=True)),
        line("bad-model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}),
        line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        line("req-1", "/v1/completions", {"prompt": "duplicate"}),
        "",
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    summary = run_job(
        BatchJobConfig(output=output, input=source, show_progress=False), engine, "tiny"
    )

    records = read_records(output)
    assert len(records) == 11  # one per non-blank line
    by_id = {r["custom_id"]: r for r in records if r["custom_id"] is not None}
    for i in range(3):
        response = by_id[f"req-{i}"]["response"]
        assert response["status_code"] == 200 and by_id[f"req-{i}"]["error"] is None
        assert response["body"]["usage"]["completion_tokens"] == 12
    assert by_id["bad-url"]["error"]["code"] == "invalid_url"
    for custom_id, status in [("bad-temperature", 400), ("bad-field", 400), ("bad-model", 404)]:
        response = by_id[custom_id]["response"]
        assert response["status_code"] == status, custom_id
        assert response["body"]["error"]["message"], custom_id
    assert "frobnicate" in by_id["bad-field"]["response"]["body"]["error"]["message"]
    assert "stream" in by_id["streamed"]["error"]["message"]
    anonymous = [r["error"] for r in records if r["custom_id"] is None]
    assert sorted((e["code"], e["line"]) for e in anonymous) == [
        ("invalid_json", 4),
        ("invalid_request", 10),
    ]
    duplicates = [r for r in records if r["custom_id"] == "req-1"]
    assert [r["error"]["code"] for r in duplicates if r["error"]] == ["duplicate_custom_id"]

    assert (summary.requests, summary.succeeded, summary.failed) == (11, 3, 8)
    assert summary.completion_tokens == 36
    prompt_tokens = sum(
        by_id[f"req-{i}"]["response"]["body"]["usage"]["prompt_tokens"] for i in range(3)
    )
    assert summary.prompt_tokens == prompt_tokens
    written = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert written["succeeded"] == 3 and written["failed"] == 8

    with pytest.raises(FileExistsError):  # never overwrites results unasked
        run_job(BatchJobConfig(output=output, input=source, show_progress=False), engine, "tiny")


def test_results_equal_the_servers_answers(engine, tmp_path):
    lines = [
        *good_lines(4, max_tokens=10),
        line(
            "n2",
            "/v1/completions",
            {
                "prompt": "Over the",
                "max_tokens": 6,
                "n": 2,
                "seed": 5,
                "temperature": 0.9,
                "logprobs": 2,
            },
        ),
        line(
            "schema",
            "/v1/chat/completions",
            chat(
                "A name?",
                max_tokens=24,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}},
                            "required": ["name"],
                        },
                    },
                },
            ),
        ),
        line("bad", "/v1/completions", {"prompt": "x", "top_p": 3}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    run_job(BatchJobConfig(output=output, input=source, show_progress=False), engine, "tiny")
    records = {r["custom_id"]: r for r in read_records(output)}

    url, server = serve(build_app(engine, ServerConfig(served_model_name="tiny")))
    try:
        for text in lines:
            request = json.loads(text)
            answer = httpx.post(url + request["url"], json=request["body"], timeout=60)
            response = records[request["custom_id"]]["response"]
            assert response["status_code"] == answer.status_code, request["custom_id"]
            if answer.status_code == 200:
                assert_same(strip_ids(response["body"]), strip_ids(answer.json()))
                assert response["request_id"] == response["body"]["id"]
            else:
                assert response["body"] == answer.json()
    finally:
        server.should_exit = True


def test_resume_after_a_kill_gives_one_result_per_custom_id(engine, tiny_model_dir, tmp_path):
    count = 40
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(good_lines(count, max_tokens=40)) + "\n")
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable, "-m", "jaxinfer.run_batch", f"--model={tiny_model_dir}",
        f"--input={source}", f"--output={output}", "--max_num_seqs=1",
        "--max_num_batched_tokens=64", "--block_size=8", "--num_kv_blocks=128",
        "--max_model_len=128", "--noprogress",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if output.exists() and output.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not output.with_name("out.jsonl.summary.json").exists()
    before = read_records(output)
    assert 3 <= len(before) < count, "the run was not interrupted midway"
    with output.open("a") as f:  # as if the kill had cut a record in half
        f.write('{"id": "batch_req_x", "custom_id": "req-')

    summary = run_job(
        BatchJobConfig(output=output, input=source, resume=True, show_progress=False),
        engine,
        "tiny",
    )
    records = read_records(output)
    assert sorted(r["custom_id"] for r in records) == sorted(f"req-{i}" for i in range(count))
    assert records[: len(before)] == before
    assert summary.requests == summary.succeeded == count
    assert summary.run_requests == count - len(before)
    texts = {}
    for r in records:
        choice = r["response"]["body"]["choices"][0]
        texts[r["custom_id"]] = choice.get("text", choice.get("message", {}).get("content"))
    fresh = tmp_path / "fresh.jsonl"
    run_job(BatchJobConfig(output=fresh, input=source, show_progress=False), engine, "tiny")
    for r in read_records(fresh):  # the killed run's greedy answers are the same
        choice = r["response"]["body"]["choices"][0]
        assert texts[r["custom_id"]] == choice.get("text", choice.get("message", {}).get("content"))


def test_overwrite_keeps_the_old_results_until_the_run_ends(engine, tmp_path, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(good_lines(2, max_tokens=3)) + "\n")
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "old"}\n')
    config = BatchJobConfig(output=output, input=source, overwrite=True, show_progress=False)

    async def interrupted(app, items, write, *args):
        write({"custom_id": "new"})
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("jaxinfer.batch.job.run_items", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_job(config, engine, "tiny")
    assert output.read_text() == '{"custom_id": "old"}\n'  # an interrupted run replaced nothing
    summary = run_job(config, engine, "tiny")
    assert summary.succeeded == 2
    assert sorted(r["custom_id"] for r in read_records(output)) == ["req-0", "req-1"]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_prompts_file_plain_and_jsonl(engine, tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("Hello there\n\nWhat is a fox?\n")
    output = tmp_path / "plain.jsonl"
    config = BatchJobConfig(
        output=output,
        prompts_file=plain,
        prompt_format="completion",
        sampling={"max_tokens": 5, "temperature": 0.0, "ignore_eos": True},
        show_progress=False,
    )
    summary = run_job(config, engine, "tiny")
    records = read_records(output)
    assert sorted(r["custom_id"] for r in records) == ["prompt-1", "prompt-3"]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 5 for r in records)
    assert summary.completion_tokens == 10

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "Hi", "custom_id": "a"})
        + "\n"
        + json.dumps({"prompt": "Yo", "max_tokens": 3})
        + "\n{broken\n"
        + json.dumps({"text": "no prompt"})
        + "\n"
    )
    output = tmp_path / "jsonl.jsonl"
    config = BatchJobConfig(
        output=output, prompts_file=jsonl, sampling={"max_tokens": 7, "ignore_eos": True},
        show_progress=False,
    )  # fmt: skip
    summary = run_job(config, engine, "tiny")
    records = {r["custom_id"] or r["error"]["line"]: r for r in read_records(output)}
    assert records["a"]["response"]["body"]["object"] == "chat.completion"
    assert records["a"]["response"]["body"]["usage"]["completion_tokens"] == 7
    assert records["prompt-2"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert records[3]["error"]["code"] == "invalid_json"
    assert records[4]["error"]["code"] == "invalid_request"
    assert (summary.succeeded, summary.failed) == (2, 2)


def test_flags_that_do_not_apply_are_refused(tmp_path):
    with pytest.raises(ValueError, match="prompts_file only"):
        BatchJobConfig(output=tmp_path / "o", input=tmp_path / "i", sampling={"temperature": 1})
    with pytest.raises(ValueError, match="exactly one"):
        BatchJobConfig(output=tmp_path / "o")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer.run_batch", f"--input={tmp_path / 'missing'}",
         f"--output={tmp_path / 'o'}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "does not exist" in result.stderr


def test_random_seed_makes_unseeded_lines_repeat_and_without_it_they_do_not(engine, tmp_path):
    """--random_seed: a line that sets no seed samples with one derived from it and the
    line's custom_id (the server's own ids are random, so they no longer carry it); without
    it such lines are random, like the server's."""
    body = {"prompt": "A fox", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(line(f"sample-{i}", "/v1/completions", body) for i in range(3)) + "\n"
    )

    def texts(name, random_seed):
        output = tmp_path / f"{name}.jsonl"
        config = BatchJobConfig(
            output=output, input=source, show_progress=False, random_seed=random_seed
        )
        run_job(config, engine, "tiny")
        return {
            r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
            for r in read_records(output)
        }

    seeded = texts("a", 7)
    assert texts("b", 7) == seeded
    assert len(set(seeded.values())) == 3  # each line its own seed
    assert texts("c", 8) != seeded
    unseeded = [texts(f"u{i}", None) for i in range(2)]
    assert unseeded[0] != unseeded[1]

"""Soak test of the server: a bounded mix of good, bad and badly behaved clients.

    python -m tools.soak --minutes=10

Starts `python -m jaxinfer.serve` (the default model unless --server_args names another) on
a free loopback port and drives it with --concurrency clients for --minutes: normal chat and
completion requests (streamed and not), streams dropped after a few tokens, clients that
time out, invalid bodies and parameters, heavy but valid grammars, n > 1, the server's
limits (bodies over the limit), and clients that share X-Request-Ids: some stream a whole
answer under an id that others send at the same time and drop within milliseconds, or send
a spinning chat template and leave. It then checks that:

- every well-formed request that was not abandoned got a 2xx, and every bad one a 4xx; a
  stream under a shared id got all its tokens and [DONE];
- /health answered 200 at every probe (once a second);
- after the load, nothing is running and the KV cache is back at idle (/metrics);
- the server's log holds no traceback;
- the server's RSS at the end is within 10% of its RSS after the first minute;
- no chat-template child process is left.

Prints requests by kind, status counts, p50/p99 latency of each kind and the RSS samples,
writes them to --output as JSON, and exits 1 if a check failed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from absl import app, flags

from jaxinfer.server.background import free_port
from tools.processes import template_children

FLAGS = flags.FLAGS
flags.DEFINE_float("minutes", 10.0, "How long the load runs.")
flags.DEFINE_integer("concurrency", 8, "Clients at once.")
flags.DEFINE_list("server_args", [], "Extra flags for jaxinfer.serve (e.g. --model=...).")
flags.DEFINE_string("output", None, "Write the report here as JSON.")
flags.DEFINE_integer("seed", 0, "Seed of the request mix.")
flags.DEFINE_float("start_timeout", 900.0, "Seconds the server may take to start.")

MESSAGES, RESPONSES, EMBEDDINGS = "/v1/messages", "/v1/responses", "/v1/embeddings"
SHARED_IDS = [f"shared-{i}" for i in range(3)]  # X-Request-Ids several clients send at once
SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
TOPICS = ["the sea", "bread", "chess", "volcanoes", "owls", "rain", "trains", "music"]
HEAVY_SCHEMA = {  # valid, with many alternatives to compile
    "type": "array",
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    f"k{i}_{j}": {"type": "array", "items": {"type": "number"}} for i in range(25)
                },
            }
            for j in range(25)
        ]
    },
}


@dataclasses.dataclass
class Result:
    kind: str
    expect: str  # "ok": a 2xx; "bad": a 4xx; "gone": the client gives up, any outcome
    status: int | None  # None: the client gave up or the connection failed
    seconds: float
    detail: str = ""


def chat_body(rng: random.Random, **extra) -> dict:
    topic = rng.choice(TOPICS)
    return {
        "messages": [{"role": "user", "content": f"Tell me something about {topic}."}],
        "max_tokens": rng.randint(8, 48),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        **extra,
    }


def completion_body(rng: random.Random, **extra) -> dict:
    return {
        "prompt": f"A short note on {rng.choice(TOPICS)}:",
        "max_tokens": rng.randint(8, 48),
        "temperature": rng.choice([0.0, 0.8]),
        **extra,
    }


async def send(
    client, kind, expect, path, body=None, content=None, timeout=120.0, headers=None
) -> Result:
    start = time.perf_counter()
    try:
        if content is not None:
            response = await client.post(
                path,
                content=content,
                headers={"content-type": "application/json", **(headers or {})},
                timeout=timeout,
            )
        else:
            response = await client.post(path, json=body, timeout=timeout, headers=headers)
    except httpx.TimeoutException:
        return Result(kind, expect, None, time.perf_counter() - start, "timeout")
    except httpx.TransportError as error:
        return Result(kind, expect, None, time.perf_counter() - start, repr(error))
    detail = "" if response.status_code < 400 else response.text[:200]
    return Result(kind, expect, response.status_code, time.perf_counter() - start, detail)


async def stream(
    client, kind, path, body, keep_chunks: int | None, headers=None, tokens: int | None = None
) -> Result:
    """Reads a stream to its end (keep_chunks None) or drops it after keep_chunks chunks.
    `tokens`: the completion tokens the stream must report in its usage (599 otherwise)."""
    start = time.perf_counter()
    expect = "ok" if keep_chunks is None else "gone"
    body = {**body, "stream": True}
    if tokens is not None:
        body["stream_options"] = {"include_usage": True}
    try:
        async with client.stream("POST", path, json=body, timeout=120, headers=headers) as r:
            chunks = 0
            done = False
            usage = None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    if '"error"' in line:
                        return Result(kind, expect, 500, time.perf_counter() - start, line[:200])
                    chunks += 1
                    usage = json.loads(line[6:]).get("usage") or usage
                    if keep_chunks is not None and chunks >= keep_chunks:
                        return Result(kind, expect, None, time.perf_counter() - start, "dropped")
            status = r.status_code if done or r.status_code >= 400 else 599
            detail = ""
            if tokens is not None and status == 200:
                got = (usage or {}).get("completion_tokens")
                if got != tokens:
                    status, detail = 599, f"{got} tokens of {tokens}"
            return Result(kind, expect, status, time.perf_counter() - start, detail)
    except httpx.TransportError as error:
        return Result(kind, expect, None, time.perf_counter() - start, repr(error))


async def message_stream(client, kind, body, keep_events: int | None) -> Result:
    return await event_stream(client, kind, MESSAGES, body, ("message_stop",), keep_events)


async def event_stream(client, kind, path, body, last: tuple, keep_events: int | None) -> Result:
    """A stream of named events (Anthropic's Messages, OpenAI's Responses) read to one of
    the `last` types (keep_events None), or dropped after keep_events events."""
    start = time.perf_counter()
    expect = "ok" if keep_events is None else "gone"
    try:
        async with client.stream("POST", path, json={**body, "stream": True}, timeout=120) as r:
            events, stopped = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("type") == "error" or "error" in event:
                    return Result(kind, expect, 500, time.perf_counter() - start, line[:200])
                events += 1
                stopped |= event.get("type") in last
                if keep_events is not None and events >= keep_events:
                    return Result(kind, expect, None, time.perf_counter() - start, "dropped")
            status = r.status_code if stopped or r.status_code >= 400 else 599
            return Result(kind, expect, status, time.perf_counter() - start, "")
    except httpx.TransportError as error:
        return Result(kind, expect, None, time.perf_counter() - start, repr(error))


def invalid_request(rng: random.Random) -> tuple[str, dict | None, bytes | None]:
    """(path, json body, raw content) of a request the API must refuse with a 4xx."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    user = [{"role": "user", "content": "hi"}]
    loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    cases = [
        (completions, None, b'{"prompt": "hi", "max_tokens": 4'),  # truncated JSON
        (completions, None, b'{"prompt": "hi", "temperature": NaN}'),
        (completions, None, b'{"prompt": "\\ud800 lone surrogate"}'),
        (completions, {"prompt": "hi", "frobnicate": 1}, None),
        (completions, {"prompt": "hi", "temperature": -1}, None),
        (completions, {"prompt": "hi", "temperature": 1e-50}, None),
        (completions, {"prompt": "hi", "repetition_penalty": 1e-50}, None),
        (completions, {"prompt": "hi", "top_p": 0}, None),
        (completions, {"prompt": "hi", "max_tokens": 10**9}, None),
        (completions, {"prompt": "hi", "model": "gpt-9"}, None),
        (completions, {"prompt": "hi", "stop": ["x"] * 100}, None),
        (completions, {"prompt": "hi", "bad_words": [f"w{i}" for i in range(5000)]}, None),
        (completions, {"prompt": [[1, 2]] * 200}, None),
        (completions, {"prompt": "hi", "n": 500}, None),
        (completions, {"prompt": [10**9]}, None),
        (chat, {"messages": []}, None),
        (chat, {"messages": user, "max_completion_tokens": 0}, None),
        (chat, {"messages": user, "stream_options": {"include_usage": True}}, None),
        (chat, {"messages": user, "structured_outputs": {"regex": "(unclosed"}}, None),
        (chat, {"messages": user, "chat_template": "{{ 1 / 0 }}"}, None),
        (chat, {"messages": user, "chat_template": loop}, None),  # runs past its time limit
        (completions, None, b'{"prompt": "' + b"x" * (5 << 20) + b'"}'),  # over the body limit
        (MESSAGES, {"messages": user}, None),  # no max_tokens
        (MESSAGES, {"messages": user, "max_tokens": 4, "temperature": 3}, None),
        (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, None),
        (RESPONSES, {"input": [{"type": "web_search_call"}]}, None),
        (RESPONSES, {"input": "hi", "previous_response_id": "resp_evicted"}, None),
        (EMBEDDINGS, {"input": ["x", ""]}, None),
    ]
    return rng.choice(cases)


async def one_request(client, rng: random.Random) -> Result:
    kind = rng.choices(
        [
            "chat",
            "completion",
            "chat_stream",
            "dropped_stream",
            "client_timeout",
            "invalid",
            "heavy_grammar",
            "n_samples",
            "large_top_k",
            "bad_words",
            "shared_id_stream",
            "shared_id_dropper",
            "template_dropper",
            "messages",
            "messages_stream",
            "messages_dropped",
            "responses",
            "responses_stream",
            "embeddings",
        ],
        weights=[20, 15, 15, 10, 8, 14, 4, 6, 4, 4, 8, 12, 3, 6, 6, 4, 6, 6, 6],
    )[0]
    chat, completions = "/v1/chat/completions", "/v1/completions"
    if kind == "chat":
        return await send(client, kind, "ok", chat, chat_body(rng))
    if kind == "completion":
        return await send(client, kind, "ok", completions, completion_body(rng))
    if kind == "chat_stream":
        return await stream(client, kind, chat, chat_body(rng), keep_chunks=None)
    if kind == "dropped_stream":
        body = chat_body(rng, max_tokens=200, ignore_eos=True)
        return await stream(client, kind, chat, body, keep_chunks=rng.randint(1, 4))
    if kind == "client_timeout":
        body = completion_body(rng, max_tokens=200, ignore_eos=True)
        return await send(client, kind, "gone", completions, body, timeout=rng.uniform(0.05, 1.0))
    if kind == "invalid":
        path, body, content = invalid_request(rng)
        return await send(client, kind, "bad", path, body, content)
    if kind == "heavy_grammar":
        schema = {**HEAVY_SCHEMA, "maxItems": rng.randint(1, 3)}  # a few distinct specs
        body = chat_body(
            rng, response_format={"type": "json_schema", "json_schema": {"schema": schema}}
        )
        return await send(client, kind, "ok", chat, body)
    if kind == "n_samples":
        return await send(client, kind, "ok", completions, completion_body(rng, n=4))
    if kind == "shared_id_stream":  # others send this id meanwhile, and drop it at once
        headers = {"X-Request-Id": rng.choice(SHARED_IDS)}
        body = chat_body(rng, max_tokens=rng.randint(16, 64), ignore_eos=True)
        return await stream(
            client, kind, chat, body, None, headers=headers, tokens=body["max_tokens"]
        )
    if kind == "shared_id_dropper":
        headers = {"X-Request-Id": rng.choice(SHARED_IDS)}
        body = completion_body(rng, max_tokens=64, ignore_eos=True)
        timeout = rng.uniform(0.002, 0.05)
        return await send(client, kind, "gone", completions, body, timeout=timeout, headers=headers)
    if kind == "template_dropper":  # leaves while its template spins in a child
        body = chat_body(rng, chat_template=SPIN)
        return await send(client, kind, "gone", chat, body, timeout=rng.uniform(0.1, 0.3))
    if kind == "messages":  # Anthropic's Messages API
        return await send(client, kind, "ok", MESSAGES, chat_body(rng))
    if kind == "messages_stream":
        return await message_stream(client, kind, chat_body(rng), keep_events=None)
    if kind == "messages_dropped":
        body = chat_body(rng, max_tokens=200)
        return await message_stream(client, kind, body, keep_events=rng.randint(1, 4))
    if kind == "embeddings":  # prompts pooled on the generation path
        inputs = [f"A note on {rng.choice(TOPICS)}." for _ in range(rng.randint(1, 4))]
        return await send(client, kind, "ok", EMBEDDINGS, {"input": inputs})
    if kind in ("responses", "responses_stream"):  # OpenAI's Responses API
        body = {"input": f"Tell me about {rng.choice(TOPICS)}.", "max_output_tokens": 24}
        if kind == "responses":
            return await send(client, kind, "ok", RESPONSES, body)
        last = ("response.completed", "response.incomplete")
        return await event_stream(client, kind, RESPONSES, body, last, keep_events=None)
    if kind == "large_top_k":
        return await send(client, kind, "ok", completions, completion_body(rng, top_k=2**31))
    words = [f"{rng.choice(TOPICS)} {i}" for i in range(1000)]
    return await send(client, kind, "ok", completions, completion_body(rng, bad_words=words))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def drive(url: str, pid: int, seconds: float) -> dict:
    rng = random.Random(FLAGS.seed)
    results: list[Result] = []
    health: collections.Counter = collections.Counter()
    rss: list[tuple[float, int]] = []
    start = time.monotonic()
    stop_at = start + seconds
    limits = httpx.Limits(max_connections=FLAGS.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def worker(seed):
            local = random.Random(seed)
            while time.monotonic() < stop_at:
                results.append(await one_request(client, local))

        async def monitor():
            while time.monotonic() < stop_at:
                try:
                    status = (await client.get("/health", timeout=10)).status_code
                except httpx.TransportError:
                    status = 0
                health[status] += 1
                rss.append((time.monotonic() - start, rss_bytes(pid)))
                await asyncio.sleep(1.0)

        await asyncio.gather(
            monitor(), *(worker(rng.randrange(2**32)) for _ in range(FLAGS.concurrency))
        )
        idle = None
        for _ in range(60):  # the abandoned requests' aborts reach the engine
            text = (await client.get("/metrics", timeout=10)).text
            running = metric(text, "jaxinfer:num_requests_running")
            waiting = metric(text, "jaxinfer:num_requests_waiting")
            usage = metric(text, "jaxinfer:kv_cache_usage_perc")
            idle = {"running": running, "waiting": waiting, "kv_cache_usage": usage}
            if running == waiting == usage == 0:
                break
            await asyncio.sleep(0.5)
    children = None
    for _ in range(40):  # cancelled renders' children are killed at once
        children = template_children(pid)
        if not children:
            break
        await asyncio.sleep(0.25)
    return {
        "results": results,
        "health": dict(health),
        "rss": rss,
        "idle": idle,
        "template_children": children,
    }


def report(run: dict, log_text: str, seconds: float) -> tuple[dict, list[str]]:
    results: list[Result] = run["results"]
    by_kind: dict = {}
    for kind in sorted({r.kind for r in results}):
        mine = [r for r in results if r.kind == kind]
        answered = [r.seconds for r in mine if r.status is not None]
        by_kind[kind] = {
            "requests": len(mine),
            "statuses": dict(collections.Counter(str(r.status) for r in mine)),
            "p50_s": round(float(np.percentile(answered, 50)), 3) if answered else None,
            "p99_s": round(float(np.percentile(answered, 99)), 3) if answered else None,
        }
    failures = []
    wrong_ok = [r for r in results if r.expect == "ok" and (r.status is None or r.status >= 300)]
    wrong_bad = [r for r in results if r.expect == "bad" and not (400 <= (r.status or 0) < 500)]
    five_xx = [
        r for r in results if r.status is not None and r.status >= 500 and r.expect != "gone"
    ]
    if wrong_ok:
        failures.append(f"{len(wrong_ok)} well-formed requests failed, e.g. {wrong_ok[0]}")
    if wrong_bad:
        failures.append(f"{len(wrong_bad)} bad requests got no 4xx, e.g. {wrong_bad[0]}")
    if five_xx:
        failures.append(f"{len(five_xx)} answers were 5xx, e.g. {five_xx[0]}")
    if set(run["health"]) != {200}:
        failures.append(f"/health answered {run['health']}")
    if run["idle"] is None or any(run["idle"].values()):
        failures.append(f"not idle after the load: {run['idle']}")
    if run["template_children"]:
        failures.append(f"{run['template_children']} chat-template children left")
    if "Traceback" in log_text:
        failures.append("the server's log holds a traceback")
    rss = run["rss"]
    after_first_minute = next((b for t, b in rss if t >= 60), rss[-1][1] if rss else 0)
    final = rss[-1][1] if rss else 0
    growth = final / after_first_minute - 1 if after_first_minute else 0.0
    if abs(growth) > 0.10:
        failures.append(f"RSS moved {growth:+.1%} after the first minute")
    summary = {
        "minutes": round(seconds / 60, 2),
        "concurrency": FLAGS.concurrency,
        "requests": len(results),
        "statuses": dict(collections.Counter(str(r.status) for r in results)),
        "by_kind": by_kind,
        "health": run["health"],
        "idle_after_load": run["idle"],
        "template_children_after_load": run["template_children"],
        "rss_mb": {
            "after_first_minute": round(after_first_minute / 2**20, 1),
            "end": round(final / 2**20, 1),
            "peak": round(max((b for _, b in rss), default=0) / 2**20, 1),
            "growth": round(growth, 4),
        },
        "traceback_in_log": "Traceback" in log_text,
        "failures": failures,
    }
    return summary, failures


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="jaxinfer-soak-")) / "server.log"
    command = [
        sys.executable,
        "-m",
        "jaxinfer.serve",
        f"--port={port}",
        "--allow_request_chat_template",
        *FLAGS.server_args,
    ]
    print("server:", " ".join(command), f"(log: {log})", flush=True)
    with log.open("w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + FLAGS.start_timeout
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited while starting:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                sys.exit("the server did not start in time")
            time.sleep(1)
        seconds = FLAGS.minutes * 60
        run = asyncio.run(drive(url, server.pid, seconds))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    summary, failures = report(run, log.read_text(), seconds)
    text = json.dumps(summary, indent=2)
    print(text)
    if FLAGS.output:
        Path(FLAGS.output).write_text(text + "\n")
    if failures:
        print("FAILED:\n- " + "\n- ".join(failures))
        sys.exit(1)
    print("passed")


if __name__ == "__main__":
    app.run(main)

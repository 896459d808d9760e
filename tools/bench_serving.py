"""Online serving benchmark, in the manner of `vllm bench serve`.

    python -m tools.bench_serving --max_concurrency=1,8,32 --num_requests=32

Starts the server on the default model in this process (or uses --base_url), then sends chat
prompts as streaming completions, either at a fixed maximum concurrency or with Poisson
arrivals at --request_rate (requests/s; 0 means all at once). Reports request throughput,
output tokens per second, and mean, median and p99 of TTFT, TPOT (time per output token after
the first), ITL (gaps between streamed chunks) and end-to-end latency.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("base_url", None, "A running server; default: start one here.")
flags.DEFINE_list("max_concurrency", ["1", "8", "32"], "Concurrency levels to run.")
flags.DEFINE_integer("num_requests", 32, "Requests per level.")
flags.DEFINE_integer("output_len", 64, "Tokens per request (ignore_eos).")
flags.DEFINE_float("request_rate", 0.0, "Poisson arrival rate (requests/s); 0: no pacing.")
flags.DEFINE_integer("seed", 0, "Arrival-time seed.")

TOPICS = ["the sea", "bread", "chess", "volcanoes", "owls", "rain", "trains", "music"]


async def one(client, url, index, results):
    body = {
        "prompt": f"Write a short story about {TOPICS[index % len(TOPICS)]} (number {index}).",
        "max_tokens": FLAGS.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    results.append(
        {
            "ttft": arrivals[0] - start,
            "e2e": end - start,
            "itl": list(np.diff(arrivals)),
            "tpot": (end - arrivals[0]) / max(FLAGS.output_len - 1, 1),
        }
    )


async def run_level(url: str, concurrency: int) -> dict:
    rng = np.random.default_rng(FLAGS.seed)
    results: list[dict] = []
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def gated(index):
            async with limit:
                await one(client, url, index, results)

        start = time.perf_counter()
        tasks = []
        for index in range(FLAGS.num_requests):
            tasks.append(asyncio.create_task(gated(index)))
            if FLAGS.request_rate > 0:
                await asyncio.sleep(rng.exponential(1 / FLAGS.request_rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "results": results}


def report(concurrency: int, run: dict) -> None:
    results, elapsed = run["results"], run["elapsed"]
    output_tokens = FLAGS.output_len * len(results)

    def stats(values):
        values = np.asarray(values) * 1e3
        return f"mean {values.mean():.1f} median {np.median(values):.1f} p99 {np.percentile(values, 99):.1f} ms"

    print(f"--- max concurrency {concurrency}: {len(results)} requests in {elapsed:.1f} s")
    print(
        f"request throughput {len(results) / elapsed:.2f} req/s, "
        f"output {output_tokens / elapsed:.1f} tok/s"
    )
    print(f"TTFT {stats([r['ttft'] for r in results])}")
    print(f"TPOT {stats([r['tpot'] for r in results])}")
    print(f"ITL  {stats([x for r in results for x in r['itl']])}")
    print(f"E2E  {stats([r['e2e'] for r in results])}")


def main(argv):
    del argv
    url = FLAGS.base_url
    server = None
    if url is None:
        from jaxinfer.config import EngineOptions
        from jaxinfer.engine.llm_engine import LLMEngine
        from jaxinfer.server.app import ServerConfig, build_app
        from jaxinfer.server.async_engine import AsyncEngine
        from jaxinfer.server.background import serve

        engine = LLMEngine(EngineOptions())
        url, server = serve(build_app(AsyncEngine(engine), ServerConfig("smol")))
    for concurrency in map(int, FLAGS.max_concurrency):
        report(concurrency, asyncio.run(run_level(url, concurrency)))
    if server is not None:
        server.should_exit = True


if __name__ == "__main__":
    app.run(main)

"""warmup "background": the smallest and largest token buckets compiled before serving, the rest
on a thread while the engine serves; nothing compiles on a step's path after warm-up (neither
on the server's engine thread nor in its compilations_after_warmup), and the answers are those
of an engine that compiled everything first."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import openai
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.startup.background_compile import THREAD_NAME
from jaxinfer.engine.startup.compilation_cache import COMPILE_EVENT
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from jaxinfer.server.metrics import ServerMetrics
from tests.support.engines import build_llm

pytestmark = pytest.mark.engine


class CompileThreads:
    """The names of the threads that compiled a program, in order, while open."""

    def __init__(self):
        self.threads: list[str] = []

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on)

    def _on(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.threads.append(threading.current_thread().name)


def prompts(count: int) -> list[list[int]]:
    """Prompts of 1 to 60 tokens: steps of many token buckets."""
    return [[(7 * i + j) % 200 + 3 for j in range(1 + (13 * i) % 60)] for i in range(count)]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def answers(client: openai.OpenAI) -> list[tuple[str, list[float]]]:
    """Greedy completions of every prompt, sent at once: texts and token logprobs."""

    def complete(prompt):
        choice = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1
        ).choices[0]
        return choice.text, choice.logprobs.token_logprobs

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(complete, prompts(12)))


def test_buckets_compile_in_the_background_and_never_on_the_step_path(make_llm, tiny_model_dir):
    reference = make_llm("tiny").generate(
        prompts(12), SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False
    )
    with CompileThreads() as compiles:
        engine = build_llm(
            tiny_model_dir, "tiny", warmup="background", token_buckets=(1, 2, 4, 8)
        ).engine
        buckets = engine.config.scheduler.token_buckets
        assert engine.config.resolved.warmup == "background"
        assert engine.batch_builder.ready_buckets == (buckets[0], buckets[-1])
        after_warmup = len(compiles.threads)
        metrics = ServerMetrics(engine)
        # read at once: the first background bucket takes a while (tracing the whole model)
        (compiling,) = (
            float(line.split()[1])
            for line in metrics.render().decode().splitlines()
            if line.startswith("jaxinfer:token_buckets_compiling ")
        )
        assert 0 < compiling <= len(buckets) - 2
        app = build_app(
            AsyncEngine(engine, metrics.observe_finished), ServerConfig("tiny"), metrics
        )
        url, server = serve(app)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            while_compiling = answers(client)
            assert engine.background_compile.wait(timeout=600)
            assert engine.batch_builder.ready_buckets == buckets
            assert metric(url, "jaxinfer:token_buckets_compiling") == 0
            after = answers(client)
            assert metric(url, "jaxinfer:compilations_after_warmup_total") == 0
        finally:
            server.should_exit = True
    assert [t for t in compiles.threads[after_warmup:] if t != THREAD_NAME] == []
    assert compiles.threads.count(THREAD_NAME) >= len(buckets) - 2
    for got in (while_compiling, after):
        for (text, logprobs), want in zip(got, reference, strict=True):
            assert text == want.outputs[0].text
            out = want.outputs[0]
            expected = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
            assert logprobs == pytest.approx(expected, abs=1e-4)


def test_background_is_refused_where_it_cannot_run(tiny_model_dir):
    with pytest.raises(ValueError, match=r"warmup 'background'.*per-layer"):
        build_llm(tiny_model_dir, "tiny", warmup="background", layer_execution="per_layer")

"""Offline throughput: jaxinfer against HF transformers on the same requests, in one process.

    python -m tools.bench_throughput --num_requests=32 --min_output_len=32 --max_output_len=160 \
        --baseline=hf

Requests are chat prompts (or synthetic prompts of --input_len tokens), decoded greedily with
ignore_eos, each with its own output length drawn evenly from [min_output_len, max_output_len].
With --shared_prefix_len=N every chat prompt starts with the same system message of about N
tokens; --compare_prefix_caching then runs jaxinfer with the prefix cache on and off and
reports the hit rate and the speed-up:

    python -m tools.bench_throughput --num_requests=64 --shared_prefix_len=512 \
        --min_output_len=16 --max_output_len=64 --compare_prefix_caching

--baseline names the peers run on the same prompts in the same process (tools/peers.py): `hf`
(HF transformers in static batches of --hf_batch_size, each generating until its longest request
is done, as static batching must), `llamacpp` (llama.cpp through llama-cpp-python on the GGUF
file the model comes from, one sequence at a time; `pip install -e '.[llamacpp]'`) and
`llamaserver` (llama.cpp's own server on that file, --server_slots sequences at a time with
continuous batching; `make bench` builds both).
Only the requested tokens are counted for every engine. Prints output tokens per second and
jaxinfer's ratio to each peer:

    python -m tools.bench_throughput --baseline=hf,llamacpp

This machine's speed drifts by 10-20% over minutes, which moves one run of each engine apart;
--rounds=N runs jaxinfer, the --compare engine and each peer in turn N times and also reports
the medians and the ratio per round:

    python -m tools.bench_throughput --baseline=hf,llamacpp --rounds=3

--single_stream instead sends --stream_requests requests one at a time to every engine and
reports time to first token and inter-token latency (p50, p99) for each:

    python -m tools.bench_throughput --single_stream --baseline=hf,llamacpp

--long_context runs prompts of --long_context_min to --long_context_max synthetic tokens, each
answered with --long_context_output tokens, all submitted at once, so the engine runs as many
at a time as its KV pool holds; it reports the most requests that ran at once besides the
throughput. With --compare=kv_cache_dtype=int8 it puts an int8 cache against the model-dtype
one in the same memory (kv_cache_memory_gb):

    python -m tools.bench_throughput --long_context --num_requests=24 \
        --kv_cache_memory_gb=0.5 --compare=kv_cache_dtype=int8

--quantization=int8 runs jaxinfer with weight-only int8. --compare=KEY=VALUE,... runs jaxinfer
a second time, on a second engine built with those engine options on top, on the same requests
and prints the ratio (in either mode), e.g. --compare=quantization=int8 (int8 against float32)
or --compare=weight_layout=in_out. With --rounds=N the two engines alternate N times, which is
the way to A/B an engine option on this noisy machine:

    python -m tools.bench_throughput --compare=async_scheduling=true --rounds=5
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags, parse_overrides
from jaxinfer.sampling_params import RequestOutputKind
from tools.chat_topics import TOPICS
from tools.peers import HFPeer, LlamaCppPeer, LlamaServerPeer, find_gguf

PEERS = ("hf", "llamacpp", "llamaserver")

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 32, "Requests in the run.")
flags.DEFINE_integer("min_output_len", 32, "Shortest output (tokens).")
flags.DEFINE_integer("max_output_len", 160, "Longest output (tokens).")
flags.DEFINE_integer("input_len", 0, "Synthetic prompt length in tokens; 0 uses chat prompts.")
flags.DEFINE_list("baseline", [], f"Peers to run in the same process: {', '.join(PEERS)}.")
flags.DEFINE_string("gguf", None, "GGUF file for llamacpp (default: the one in the model folder).")
flags.DEFINE_bool("single_stream", False, "Measure TTFT and ITL one request at a time instead.")
flags.DEFINE_integer("stream_requests", 4, "Requests in --single_stream mode.")
flags.DEFINE_integer("stream_output_len", 128, "Output tokens per request in --single_stream.")
flags.DEFINE_list("compare", [], "KEY=VALUE engine options of a second jaxinfer run.")

flags.DEFINE_integer("hf_batch_size", 32, "Static batch size of the HF transformers baseline.")
flags.DEFINE_integer("server_slots", 32, "llama-server's parallel sequences (-np).")
flags.DEFINE_integer(
    "threads", 2, "CPU threads for torch and llama.cpp (XLA uses the machine's cores)."
)
flags.DEFINE_integer(
    "rounds",
    1,
    "With --baseline or --compare: rounds of each engine in turn; medians reported.",
)
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_bool("long_context", False, "Long synthetic prompts, all at once (see above).")
flags.DEFINE_integer("long_context_min", 2048, "--long_context: shortest prompt (tokens).")
flags.DEFINE_integer("long_context_max", 4096, "--long_context: longest prompt (tokens).")
flags.DEFINE_integer("long_context_output", 128, "--long_context: output tokens per request.")
flags.DEFINE_integer("shared_prefix_len", 0, "Tokens of a system prompt shared by all requests.")
flags.DEFINE_bool("compare_prefix_caching", False, "Also run jaxinfer without prefix caching.")
flags.DEFINE_bool(
    "compare_run_batch",
    False,
    "Also send the same requests through run_batch's path (the server's request handling, "
    "all lines at once) on the same engine.",
)
flags.DEFINE_bool(
    "compare_async",
    False,
    "Also run jaxinfer with one step at a time (no async scheduling) on the same engine.",
)

define_engine_flags()  # jaxinfer's options (--config, --quantization, ...), as the server's

SYSTEM_SENTENCE = (
    "You are a careful assistant for a library of technical manuals; answer briefly, cite the "
    "manual section when you can, and say so plainly when a question falls outside them. "
)


def build_workload(llm: LLM) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(FLAGS.seed)
    tokenizer = llm.tokenizer
    prompts = []
    if FLAGS.long_context:
        lengths = rng.integers(
            FLAGS.long_context_min, FLAGS.long_context_max + 1, FLAGS.num_requests
        )
        prompts = [rng.integers(100, 40000, size=n).tolist() for n in lengths]
        return prompts, [FLAGS.long_context_output] * FLAGS.num_requests
    for i in range(FLAGS.num_requests):
        if FLAGS.input_len:
            prompts.append(rng.integers(100, 40000, size=FLAGS.input_len).tolist())
        else:
            question = f"Explain {TOPICS[i % len(TOPICS)]} to a {10 + i}-year-old."
            messages = [{"role": "user", "content": question}]
            if FLAGS.shared_prefix_len:
                messages.insert(0, {"role": "system", "content": system_prompt(tokenizer)})
            text = tokenizer.apply_chat_template(messages)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    output_lens = np.linspace(FLAGS.min_output_len, FLAGS.max_output_len, FLAGS.num_requests)
    output_lens = rng.permutation(np.round(output_lens).astype(int)).tolist()
    return prompts, output_lens


def system_prompt(tokenizer) -> str:
    """A system message of about --shared_prefix_len tokens."""
    sentence_len = len(tokenizer.encode(SYSTEM_SENTENCE, add_special_tokens=False))
    return SYSTEM_SENTENCE * max(1, round(FLAGS.shared_prefix_len / sentence_len))


@dataclasses.dataclass(frozen=True)
class Run:
    seconds: float
    peak_running: int  # the most requests that ran in one step


def run_engine(llm: LLM, prompts, output_lens) -> Run:
    """The workload through the engine, all requests submitted at once (as LLM.generate does),
    stepped here to see how many run at a time."""
    engine = llm.engine
    assert engine.reset_prefix_cache()  # every run starts cold: no hits from the last one
    start = time.perf_counter()
    lengths = {}
    for prompt, n in zip(prompts, output_lens, strict=True):
        params = SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        lengths[engine.add_request(prompt, params).request_id] = n
    peak = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert len(output.outputs[0].token_ids) == lengths.pop(output.request_id)
        peak = max(peak, engine.stats().num_running)
    assert not lengths
    return Run(time.perf_counter() - start, peak)


def run_jaxinfer(llm: LLM, prompts, output_lens) -> float:
    return run_engine(llm, prompts, output_lens).seconds


def run_batch_job(llm: LLM, prompts, output_lens) -> float:
    """The workload as an OpenAI Batch file through jaxinfer.batch (token-id prompts)."""
    import json
    import tempfile

    from jaxinfer.batch.job import BatchJobConfig, run_job
    from jaxinfer.server.async_engine import AsyncEngine

    assert llm.engine.reset_prefix_cache()
    with tempfile.TemporaryDirectory() as folder:
        source, output = Path(folder) / "in.jsonl", Path(folder) / "out.jsonl"
        lines = [
            {
                "custom_id": str(i),
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            }
            for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))
        ]
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        config = BatchJobConfig(output=output, input=source, show_progress=False)
        summary = run_job(config, AsyncEngine(llm.engine), "bench")
    assert summary.succeeded == len(prompts) and summary.completion_tokens == sum(output_lens)
    return summary.wall_seconds


def make_llm(**overrides) -> LLM:
    """An engine with the flags' options (over --config), `overrides` on top."""
    options = dataclasses.replace(engine_options_from_flags(), **overrides)
    return LLM(**dataclasses.asdict(options))


def compared_options() -> dict:
    """--compare as engine options, typed as the flags are."""
    try:
        return parse_overrides(FLAGS.compare)
    except ValueError as error:
        raise app.UsageError(f"--compare: {error}") from None


def make_peer(name: str, llm: LLM, context: int):
    model_path = llm.engine.config.model.path
    if name == "hf":
        return HFPeer(model_path, FLAGS.threads)
    gguf = FLAGS.gguf or find_gguf(model_path)
    if name == "llamaserver":
        return LlamaServerPeer(gguf, FLAGS.threads, context, FLAGS.server_slots)
    return LlamaCppPeer(gguf, FLAGS.threads, context)


def close(peer) -> None:
    if hasattr(peer, "close"):
        peer.close()


def peer_throughput(peer, prompts, output_lens) -> float:
    if peer.name == "hf":
        return peer.throughput(prompts, output_lens, FLAGS.hf_batch_size)
    return peer.throughput(prompts, output_lens)


def jaxinfer_stream(llm: LLM, prompt: list[int], output_len: int) -> list[float]:
    """Seconds from the request's arrival to each output token (the engine's own metrics)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    assert llm.engine.reset_prefix_cache()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    metrics = output.metrics
    first = metrics.first_token_time - metrics.arrival_time
    return list(first + np.cumsum([0.0, *metrics.inter_token_latencies]))


def latency_summary(name: str, runs: list[list[float]]) -> tuple[float, float]:
    """Prints TTFT and ITL percentiles over all runs; returns (median TTFT, median ITL)."""
    ttft = np.array([times[0] for times in runs]) * 1e3
    itl = np.concatenate([np.diff(times) for times in runs]) * 1e3
    print(
        f"{name}: TTFT p50 {np.median(ttft):.1f} ms, p99 {np.percentile(ttft, 99):.1f} ms; "
        f"ITL p50 {np.median(itl):.2f} ms, p99 {np.percentile(itl, 99):.2f} ms "
        f"({len(runs)} requests, {len(itl)} gaps)"
    )
    return float(np.median(ttft)), float(np.median(itl))


def single_stream(llm: LLM, prompts: list[list[int]]) -> None:
    prompts = prompts[: FLAGS.stream_requests]
    output_len = FLAGS.stream_output_len
    context = max(map(len, prompts)) + output_len + 16
    print(f"single stream: {len(prompts)} requests one at a time, {output_len} tokens each")
    jaxinfer_stream(llm, prompts[0], 4)  # first-call effects out of the way
    ours = latency_summary("jaxinfer", [jaxinfer_stream(llm, p, output_len) for p in prompts])
    engines = {"jaxinfer": ours}
    if FLAGS.compare:
        other = make_llm(**compared_options())
        jaxinfer_stream(other, prompts[0], 4)
        name = f"jaxinfer {','.join(FLAGS.compare)}"
        theirs = latency_summary(name, [jaxinfer_stream(other, p, output_len) for p in prompts])
        print(f"{name} / jaxinfer: TTFT {theirs[0] / ours[0]:.2f}x, ITL {theirs[1] / ours[1]:.2f}x")
        engines[name] = theirs
        del other
    for name in FLAGS.baseline:
        peer = make_peer(name, llm, context)
        peer.stream(prompts[0], 4)
        theirs = latency_summary(name, [peer.stream(p, output_len) for p in prompts])
        for engine, (ttft, itl) in engines.items():
            print(
                f"{engine} / {name}: TTFT {ttft / theirs[0]:.2f}x, ITL {itl / theirs[1]:.2f}x "
                "(below 1 is faster)"
            )
        close(peer)


def shared_prefix_tokens(prompts) -> int:
    first = prompts[0]
    return min(
        next((i for i, (a, b) in enumerate(zip(first, p, strict=False)) if a != b), len(p))
        for p in prompts[1:]
    )


def main(argv):
    del argv
    unknown = set(FLAGS.baseline) - set(PEERS)
    if unknown:
        raise app.UsageError(f"unknown baselines: {sorted(unknown)} (supported: {PEERS})")
    llm = make_llm()
    prompts, output_lens = build_workload(llm)
    total = sum(output_lens)
    print(
        f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, outputs {min(output_lens)}-{max(output_lens)} "
        f"({total} output tokens), greedy, ignore_eos"
    )
    print(f"jaxinfer warm-up: {llm.engine.warmup_seconds:.1f} s")
    blocks = ", ".join(llm.engine.gguf_weights) or "none"
    fmt = llm.engine.config.resolved.weight_format
    if fmt.startswith("int4"):
        print(f"jaxinfer {fmt}; taken from the GGUF file's 4-bit blocks: {blocks}")
    else:
        mode = "int8" if FLAGS.int8_activations else "exact"
        print(f"jaxinfer weights in GGUF blocks ({mode} activations): {blocks}")
    if FLAGS.single_stream:
        single_stream(llm, prompts)
        return
    if FLAGS.shared_prefix_len and len(prompts) > 1:
        print(f"shared prefix: {shared_prefix_tokens(prompts)} tokens")
    first_run = run_engine(llm, prompts, output_lens)
    ours = first_run.seconds
    stats = llm.engine.stats()
    hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
    print(
        f"jaxinfer: {ours:.2f} s, {total / ours:.1f} output tokens/s "
        f"(prefix cache hit rate {hit_rate:.1%}, {stats.num_preemptions} preemptions)"
    )
    if FLAGS.compare_async:
        engine = llm.engine
        async_config = engine.config
        engine.config = dataclasses.replace(async_config, async_scheduling=False)
        sync = run_jaxinfer(llm, prompts, output_lens)
        engine.config = async_config
        again = run_jaxinfer(llm, prompts, output_lens)
        print(
            f"jaxinfer one step at a time: {sync:.2f} s, {total / sync:.1f} output tokens/s; "
            f"async again: {again:.2f} s; ratio async / sync: {2 * sync / (ours + again):.2f}x"
        )
    if FLAGS.compare_run_batch:
        batch = run_batch_job(llm, prompts, output_lens)
        print(
            f"jaxinfer through run_batch: {batch:.2f} s, {total / batch:.1f} output tokens/s; "
            f"ratio run_batch / LLM.generate: {ours / batch:.2f}x"
        )
    engines = {"jaxinfer": ours}
    variants = {"jaxinfer": llm}  # the jaxinfer engines each round runs
    if FLAGS.long_context:
        cache = llm.engine.config.cache
        print(
            f"jaxinfer KV cache: {cache.kv_format.name}, {cache.capacity_tokens()} tokens; at "
            f"most {first_run.peak_running} requests at once"
        )
    if FLAGS.compare:
        other = make_llm(**compared_options())
        other_run = run_engine(other, prompts, output_lens)
        theirs = other_run.seconds
        print(
            f"jaxinfer {','.join(FLAGS.compare)}: {theirs:.2f} s, {total / theirs:.1f} output "
            f"tokens/s; ratio to the first run: {ours / theirs:.2f}x (above 1: faster)"
        )
        if FLAGS.long_context:
            cache = other.engine.config.cache
            print(
                f"jaxinfer {','.join(FLAGS.compare)} KV cache: {cache.kv_format.name}, "
                f"{cache.capacity_tokens()} tokens; at most {other_run.peak_running} requests "
                "at once"
            )
        engines[f"jaxinfer {','.join(FLAGS.compare)}"] = theirs
        variants[f"jaxinfer {','.join(FLAGS.compare)}"] = other
        if FLAGS.rounds == 1:
            again = run_jaxinfer(llm, prompts, output_lens)
            print(f"jaxinfer first configuration again: {again:.2f} s")
    if FLAGS.compare_prefix_caching:
        del llm
        llm = make_llm(enable_prefix_caching=False)
        without = run_jaxinfer(llm, prompts, output_lens)
        print(
            f"jaxinfer without prefix caching: {without:.2f} s, {total / without:.1f} output "
            f"tokens/s ({llm.engine.stats().num_preemptions} preemptions)"
        )
        print(f"ratio prefix caching on / off: {without / ours:.2f}x")
    context = max(map(len, prompts)) + max(output_lens) + 16
    peers = {name: make_peer(name, llm, context) for name in FLAGS.baseline}
    times = {name: [seconds] for name, seconds in engines.items()} | {name: [] for name in peers}
    for round_index in range(FLAGS.rounds):
        if round_index:  # jaxinfer again, then each peer: the machine's drift hits all alike
            for name, engine in variants.items():
                seconds = run_jaxinfer(engine, prompts, output_lens)
                times[name].append(seconds)
                engines[name] = seconds
                print(f"round {round_index + 1}: {name} {seconds:.2f} s")
        for name, peer in peers.items():
            theirs = peer_throughput(peer, prompts, output_lens)
            times[name].append(theirs)
            how = {
                "hf": f"static batches of {FLAGS.hf_batch_size}",
                "llamaserver": f"{FLAGS.server_slots} slots, continuous batching",
            }.get(name, "one at a time")
            print(f"{name} ({how}): {theirs:.2f} s, {total / theirs:.1f} output tokens/s")
            for engine, seconds in engines.items():
                print(f"ratio {engine} / {name}: {theirs / seconds:.2f}x")
    for peer in peers.values():
        close(peer)
    if FLAGS.rounds > 1 and len(times) > 1:
        median = {name: float(np.median(values)) for name, values in times.items()}
        print(f"over {FLAGS.rounds} alternating rounds (median seconds):")
        for name, seconds in median.items():
            print(f"  {name}: {seconds:.2f} s, {total / seconds:.1f} output tokens/s")
        for name in [*list(variants)[1:], *peers]:
            per_round = [t / o for t, o in zip(times[name], times["jaxinfer"], strict=True)]
            print(
                f"  ratio jaxinfer / {name}: {median[name] / median['jaxinfer']:.2f}x of the "
                f"medians; per round {', '.join(f'{r:.2f}x' for r in per_round)}"
            )


if __name__ == "__main__":
    app.run(main)

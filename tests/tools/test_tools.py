"""The GPU-check tools run on CPU too (small shapes), so they do not rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_kernels.build import can_build

# The tools run end to end, each a process that compiles (a model, kernels, a server).
pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_kernel_bench_compares_every_implementation(tmp_path):
    output = tmp_path / "kernels.json"
    run(
        "-m",
        "tools.kernel_bench",
        "--shapes=smollm2",
        "--batch=2",
        "--decode_batches=2,3",
        "--contexts=40",
        "--prefill_len=32",
        "--repeats=1",
        "--kv_cache_dtypes=auto,int8",
        f"--output_json={output}",
    )
    rows = json.loads(output.read_text())["rows"]
    cases = {row["case"] for row in rows}
    assert cases == {
        "decode attn b2 c40",
        "decode attn b3 c40",
        "decode attn b2 c40 int8",
        "decode attn b3 c40 int8",
        "prefill attn 32",
        "ffn t2",
        "ffn t32",
        "experts t2",
        "add+rmsnorm t2",
        "Q4_K down t2",
        "Q6_K down t2",
        "Q8_0 down t2",
    }
    for case in cases:
        impls = {row["impl"]: row for row in rows if row["case"] == case}
        if "down" in case:  # a projection in block formats, beside XLA's of its dense weight
            assert set(impls) == {"reference", "pallas_interpret", "dense_xla"}
            assert all(row["max_abs_error"] < 1e-3 and row["ms"] > 0 for row in impls.values())
            continue
        impls = {row["impl"]: row for row in rows if row["case"] == case}
        # attention also has the C++ kernel (built by the tool) where a compiler exists
        cpu = {"cpu"} if "attn" in case and can_build() else set()
        invariant = {"invariant"} if "rmsnorm" in case else set()  # the batch-invariant norm
        assert set(impls) == {"reference", "pallas_interpret", *cpu, *invariant}
        assert impls["pallas_interpret"]["max_abs_error"] < 1e-4, case
        if cpu:
            assert impls["cpu"]["max_abs_error"] < 1e-4, case
        assert all(row["ms"] > 0 for row in impls.values())
        # a quantized cache's case: each kernel's speed-up over the model-dtype cache
        quantized = case.endswith("int8")
        assert all(("speedup_over_model_dtype_cache" in row) == quantized for row in impls.values())


def test_decode_roofline_reports_each_batch(tmp_path):
    output = tmp_path / "decode.json"
    run(
        "-m",
        "tools.decode_roofline",
        "--shape=smollm2",
        "--batch_sizes=1,4",
        "--context=48",
        "--steps=1",
        "--profile_batch_sizes=4",
        f"--output_json={output}",
    )
    rows = json.loads(output.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 4]
    assert all(row["step_ms"] > 0 and row["roofline_ms"] > 0 for row in rows)
    kernels = rows[1]["kernels"]  # the profile: device (here XLA:CPU) time per kernel
    assert kernels and all(k["ms"] > 0 for k in kernels) and "kernels" not in rows[0]
    assert sum(k["share"] for k in kernels) == pytest.approx(1.0)


def test_hybrid_bench_times_each_model_at_each_context(tmp_path):
    output = tmp_path / "hybrid.json"
    run(
        "-m",
        "tools.bench_hybrid",
        "--contexts=64,256",
        "--batch_size=2",
        "--layers=4",
        "--hidden_size=64",
        "--steps=1",
        f"--output_json={output}",
    )
    report = json.loads(output.read_text())
    assert report["contexts"] == [64, 256]
    steps = report["step_seconds"]
    assert set(steps) == {"hybrid", "attention", "linear"}
    assert all(len(times) == 2 and min(times) > 0 for times in steps.values())
    assert len(report["hybrid_over_attention"]) == 2


def test_bench_compressed_reports_steps_and_kv_bytes_beside_dense(tmp_path):
    output = tmp_path / "compressed.json"
    run(
        "-m",
        "tools.bench_compressed",
        "--contexts=256,512",
        "--layers=4",
        "--hidden_size=64",
        "--steps=1",
        "--rounds=1",
        "--impls=reference,cpu",
        f"--output_json={output}",
    )
    report = json.loads(output.read_text())
    assert report["contexts"] == [256, 512]
    for name in ("compressed", "dense"):
        for impl in ("reference", "cpu"):
            assert min(report[f"{name}[{impl}]"]["step_seconds"]) > 0
    compressed = report["compressed[cpu]"]["kv_bytes"]
    dense = report["dense[cpu]"]["kv_bytes"]
    # the dense model's bytes about double with the context; the compressed one's grow by
    # its entries alone (its window's blocks and compressor states stay)
    assert dense[1] > 1.9 * dense[0]
    assert compressed[1] / dense[1] < compressed[0] / dense[0]


def test_prefix_caching_bench_runs_on_a_written_hybrid_model(tmp_path):
    """bench_hybrid --write_model, then bench_throughput's prefix-caching comparison on it
    (the hybrid's states restored from checkpoints)."""
    folder = tmp_path / "hybrid"
    run("-m", "tools.bench_hybrid", f"--write_model={folder}", "--layers=4", "--hidden_size=64")
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    output = run(
        "-m",
        "tools.bench_throughput",
        f"--model={folder}",
        "--num_requests=4",
        "--shared_prefix_len=64",
        "--min_output_len=2",
        "--max_output_len=3",
        "--max_num_batched_tokens=128",
        "--token_buckets=16,128",
        "--compare_prefix_caching",
    )
    hit_rate = float(output.split("prefix cache hit rate ")[1].split("%")[0])
    assert hit_rate > 0 and "ratio prefix caching on / off" in output


def test_gated_delta_bench_times_both_forms(tmp_path):
    output = tmp_path / "gated_delta.json"
    run(
        "-m",
        "tools.bench_gated_delta",
        "--tokens=16,70",
        "--key_heads=1",
        "--value_heads=2",
        "--head_dim=16",
        "--repeats=1",
        "--reference",
        f"--output_json={output}",
    )
    report = json.loads(output.read_text())
    assert report["tokens"] == [16, 70]
    assert set(report["seconds"]) == {"cpu_recurrent", "cpu_chunked", "reference_chunked"}
    assert all(len(times) == 2 and min(times) > 0 for times in report["seconds"].values())
    assert len(report["chunked_speedup"]) == 2


def test_shape_bench_serves_every_request_with_random_weights(tmp_path):
    output = tmp_path / "shape.json"
    args = ["--shape=smollm2", "--num_requests=6", "--max_input_len=40", "--max_output_len=8"]
    args += ["--min_input_len=8", "--min_output_len=2", "--token_buckets=64"]
    args += ["--max_num_batched_tokens=64", "--kv_cache_memory_gb=0.25", "--layer_execution=scan"]
    run("-m", "tools.bench_shape", *args, f"--output_json={output}")
    row = json.loads(output.read_text())["row"]
    assert row["requests"] == 6 and row["output_tokens_per_s"] > 0
    assert 0.3 < row["weights_gb"] < 0.6  # SmolLM2-135M's layers and head in float32
    assert 0 < row["percent_of_roofline"] < 100


def test_moe_bench_reports_each_token_count(tmp_path):
    if not can_build():
        pytest.skip("no C++ compiler to build the matmul kernel")
    output = tmp_path / "moe.json"
    run(
        "-m",
        "tools.bench_moe",
        "--tokens=1,6",
        "--hidden=64",
        "--experts=8",
        "--top_k=2",
        "--expert_intermediate=32",
        "--rounds=1",
        "--repeats=1",
        "--reference",
        f"--output_json={output}",
    )
    rows = json.loads(output.read_text())["layer"]
    assert [row["tokens"] for row in rows] == [1, 6]
    assert all(
        row["moe_ms"] > 0 and row["dense_ms"] > 0 and row["reference_moe_ms"] > 0 for row in rows
    )


def test_cpu_matmul_bench_reports_every_weight():
    if not can_build():
        pytest.skip("no C++ compiler to build the matmul kernel")
    out = run("-m", "tools.bench_cpu_matmul", "--rows=2", "--repeats=1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and " ms |" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == ["gate_up", "down", "qkv", "lm_head"]


def test_pallas_sweep_checks_every_configuration_against_the_reference(tmp_path):
    """tools/tune_pallas.py (the GPU sweep) through Pallas' interpreter: the decode-attention
    and FFN cases, the defaults plus one configuration each, all agreeing with the reference
    (the prefill case runs the same attention code)."""
    output = tmp_path / "tune.json"
    out = run(
        "-m",
        "tools.tune_pallas",
        "--interpret",
        "--shape=smollm2",
        "--batch=2",
        "--context=32",
        "--prefill_len=16",
        "--max_configs=1",
        "--cases=decode,ffn",
        f"--output_json={output}",
    )
    rows = json.loads(output.read_text())["rows"]
    cases = ("gate_up t2", "gate_up t16", "decode b2 c32")  # the FFN first
    assert [(r["case"], r["config"] == "defaults") for r in rows] == [
        (case, first) for case in cases for first in (True, False)
    ]
    assert all(r["max_abs_error"] < 1e-4 and r["ms"] > 0 for r in rows)
    assert "fastest per case" in out


def test_soak_runs_and_checks_a_server(tmp_path, tiny_model_dir):
    """tools/soak.py on the tiny model, for a few seconds (the engine options of
    test_server's SIGTERM test, whose compiled programs it reuses)."""
    output = tmp_path / "soak.json"
    server_args = [
        f"--model={tiny_model_dir}",
        "--max_model_len=128",
        "--max_num_seqs=4",
        "--block_size=8",
        "--num_kv_blocks=64",
        "--max_num_batched_tokens=32",
    ]
    run(
        "-m",
        "tools.soak",
        "--minutes=0.2",
        "--concurrency=4",
        f"--server_args={','.join(server_args)}",
        f"--output={output}",
    )
    report = json.loads(output.read_text())
    assert report["failures"] == [] and report["requests"] > 20
    assert set(report["health"]) == {"200"}
    assert report["idle_after_load"] == {"running": 0, "waiting": 0, "kv_cache_usage": 0}
    assert {"chat", "invalid"} <= set(report["by_kind"])


def test_spec_replay_replays_host_proposers_over_recorded_outputs(tmp_path):
    """An output that copies its prompt but for one edit: each host proposer's replay
    proposes most of it, in far fewer steps than one a token."""
    text = list(range(100, 160))
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"edit": [[text, [*text[:20], 999, *text[21:]]]]}))
    out = run("-m", "tools.spec_replay", f"--record={record}", "--workloads=edit", "--token_ms=0")
    for method in ("ngram", "suffix"):
        line = next(line for line in out.splitlines() if line.strip().startswith(method))
        steps = int(line.split("; ")[1].split(" steps")[0])
        assert steps <= 16, line

"""The GPU scripts' structure on CPU: every stage accounted for in the summary, the GPU ones
skipped with the reason, nothing written outside the output folder; and the token check's
verdicts on made-up results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools import smoke_tokens

ROOT = Path(__file__).resolve().parents[2]


def _untracked() -> set[str]:
    result = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(result.stdout.splitlines())


@pytest.mark.parametrize(
    "script, first, gpu_stages",
    [
        ("gpu_smoke.sh", "jax", ["nvidia_smi", "kernel_check", "engine", "kernel_tests"]),
        (
            "gpu_check.sh",
            "gpu_env",
            ["kernel_bench", "tune_pallas", "decode_roofline", "bench_shape", "invariance"],
        ),
    ],
)
def test_gpu_script_on_cpu_skips_the_gpu_stages(tmp_path, script, first, gpu_stages):
    before = _untracked()
    out = tmp_path / "out"
    result = subprocess.run(
        [f"tools/{script}", str(out), "/no/model.gguf"][: 3 if script == "gpu_smoke.sh" else 2],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0].split()[:2] == [first, "pass"]
    for name, line in zip(gpu_stages, lines[1:-1], strict=True):
        assert line.split()[:2] == [name, "skipped"]
        assert "no GPU: the JAX backend is cpu" in line
    assert lines[-1].startswith("ok after")
    assert sorted(p.name for p in out.iterdir()) == sorted(["summary.txt", f"{first}.txt"])
    assert "backend cpu" in (out / f"{first}.txt").read_text()
    assert _untracked() == before  # no bytecode, cache or output in the working tree


def _record(tokens, logprobs):
    return dict(prompt_token_ids=[1, 2], token_ids=tokens, logprobs=logprobs)


def test_the_token_check_tells_near_ties_from_real_differences():
    expected = [_record([5, 6, 7], [-0.1, -0.7, -0.2])]
    # Same tokens, logprobs a little off: passes.
    got = [_record([5, 6, 7], [-0.1, -0.6, -0.2])]
    scored = [dict(logprobs=[-0.12, -0.65, -0.25], top_logprobs=[-0.12, -0.65, -0.25])]
    [row] = smoke_tokens.compare(expected, got, scored, tolerance=0.5)
    assert row["passed"] and row["matching_tokens"] == 3 and row["max_near_tie_gap"] == 0
    # A flip at a near-tie (the CPU's token 0.05 below this engine's top): passes, 1 alike.
    got = [_record([5, 9, 9], [-0.1, -0.6, -0.2])]
    scored = [dict(logprobs=[-0.1, -0.7, -0.2], top_logprobs=[-0.1, -0.65, -0.2])]
    [row] = smoke_tokens.compare(expected, got, scored, tolerance=0.5)
    assert row["passed"] and row["matching_tokens"] == 1
    assert row["max_near_tie_gap"] == pytest.approx(0.05)
    # The CPU's token far below this engine's top: a real difference.
    scored = [dict(logprobs=[-0.1, -3.0, -0.2], top_logprobs=[-0.1, -0.1, -0.2])]
    [row] = smoke_tokens.compare(expected, got, scored, tolerance=0.5)
    assert not row["passed"]
    # Logprobs drifted from the CPU's though the argmax agrees: fails too.
    scored = [dict(logprobs=[-0.1, -1.7, -0.2], top_logprobs=[-0.1, -1.7, -0.2])]
    [row] = smoke_tokens.compare(expected, got, scored, tolerance=0.5)
    assert not row["passed"] and row["max_logprob_difference"] == pytest.approx(1.0)
    # Another tokenization (another model): fails whatever the numbers.
    got = [dict(_record([5, 6, 7], [-0.1, -0.7, -0.2]), prompt_token_ids=[1, 3])]
    scored = [dict(logprobs=[-0.1, -0.7, -0.2], top_logprobs=[-0.1, -0.7, -0.2])]
    [row] = smoke_tokens.compare(expected, got, scored, tolerance=0.5)
    assert not row["passed"]

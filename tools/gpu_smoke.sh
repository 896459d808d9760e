#!/usr/bin/env bash
# The first run on a GPU machine (issue 21): at most 5 minutes, writing only under OUT_DIR.
#
#   tools/gpu_smoke.sh OUT_DIR [MODEL]      # from the repository root
#
# MODEL is the default model's .gguf (or a folder), for the engine stage; without it that
# stage is skipped (the GPU machine has no network; docs/perf/README.md says how to bring it).
# Stages, each in its own process under its own time limit, so a crash or hang in one leaves
# the others their time:
#   jax           JAX, jaxlib and Pallas backend versions, the devices (decides the rest)
#   nvidia_smi    the GPU, its driver and memory
#   kernel_check  each Pallas kernel compiled and checked against its reference at the default
#                 model's and Llama-3-8B's shapes, bfloat16 and float32 (tools.kernel_check)
#   engine        the default model with every option "auto": 16 greedy tokens for 4 prompts
#                 against the CPU engine's (tools/data/cpu_tokens.json; tools.smoke_tokens)
#   kernel_tests  pytest -x on tests/kernels/test_kernels.py, the kernels compiled
# OUT_DIR/summary.txt says per stage pass, FAIL, TIMEOUT or skipped, and the seconds it took;
# OUT_DIR/NAME.txt holds each stage's output. On a machine without a GPU every stage but `jax`
# is skipped, and the summary says so. Exit status: 1 if a stage failed or timed out.
set -uo pipefail
out=${1:?usage: tools/gpu_smoke.sh OUT_DIR [MODEL]}
model=${2:-}
budget=300  # the H200 compiled each Pallas kernel case in 1-5 s, each engine bucket in ~5 s
source "$(dirname "$0")/gpu_stages.sh"

stage jax 25 any $python -c '
import jax, jaxlib
from pallas_kernels import gpu_lowering
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("devices", jax.devices())
print("pallas gpu backend", gpu_lowering.gpu_backend())
print("backend", jax.default_backend())'
backend=$(sed -n 's/^backend //p' "$out/jax.txt" 2>/dev/null)
backend=${backend:-unknown}

stage nvidia_smi 10 needs_gpu nvidia-smi
stage kernel_check 80 needs_gpu $python -m tools.kernel_check --shapes=smollm2,llama3_8b \
    --dtypes=bfloat16,float32 --output_json="$out/kernel_check.json"
if [ -n "$model" ] || [ "$backend" != gpu ]; then
    stage engine 110 needs_gpu $python -m tools.smoke_tokens --check=tools/data/cpu_tokens.json \
        --model="$model" --cache_dir="$out/cache" --output_json="$out/engine_tokens.json"
else
    skip engine "no MODEL given"
fi
stage kernel_tests 110 needs_gpu $python -m pytest -q -rf -p no:cacheprovider \
    tests/kernels/test_kernels.py
finish

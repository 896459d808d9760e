#!/usr/bin/env bash
# The longer GPU run, after tools/gpu_smoke.sh passes: at most 8 minutes, all
# under OUTPUT_DIR (default docs/perf, where the results are committed).
#
#   tools/gpu_check.sh [OUTPUT_DIR]        # from the repository root
#
#   gpu_env          the GPU, its driver, JAX and the commit
#   kernel_bench     tools.kernel_bench at Llama-3-8B shapes (random inputs):
#                    decode attention at 32 and 128 requests of 1k and 8k tokens (model-dtype,
#                    int8 and fp8 caches) against the measured copy bandwidth, prefill attention (4k) and the FFN against the
#                    measured bf16 matmul rate, and each kernel's error against its reference
#   tune_pallas      tools.tune_pallas: tile sizes, warps and stages of each kernel at 8B shapes
#   decode_roofline  the decode step of a random-weight Llama-3-8B-shaped model at batch 1, 32
#                    and 128 (context 1024) against weights + KV bytes over the copy bandwidth,
#                    and where its device time goes at batch 1 and 128 (tools.device_profile)
#   bench_shape      the Llama-3-8B shape (random weights, bf16) serving 256 chat-sized
#                    requests through the whole engine, against the decode roofline
#   invariance       batch_invariant on the GPU (the Pallas matmul, attention and norm): a
#                    request's tokens and logprobs alone and among others, SmolLM2's shape
# Files: summary.txt, gpu_env.txt, and NAME.txt + NAME.json for each other stage. Each stage has
# its own time limit (tools/gpu_stages.sh). Needs jax with its CUDA plugin, flax, numpy and
# absl-py; the repository is imported from the working tree (nothing is installed).
set -uo pipefail
out=${1:-docs/perf}
budget=490
source "$(dirname "$0")/gpu_stages.sh"

stage gpu_env 30 any bash -c "date -u; git rev-parse HEAD 2>/dev/null; \
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; \
    $python -c \"import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
    jax.devices()); print('backend', jax.default_backend())\""
backend=$(sed -n 's/^backend //p' "$out/gpu_env.txt" 2>/dev/null)
backend=${backend:-unknown}

stage kernel_bench 90 needs_gpu $python -m tools.kernel_bench --shapes=llama3_8b \
    --decode_batches=32,128 --contexts=1024,8192 --prefill_len=4096 \
    --kv_cache_dtypes=auto,int8,fp8_e4m3 \
    --output_json="$out/kernel_bench.json"
stage tune_pallas 70 needs_gpu $python -m tools.tune_pallas --shape=llama3_8b --budget_s=40 \
    --output_json="$out/tune_pallas.json"
stage decode_roofline 90 needs_gpu $python -m tools.decode_roofline --shape=llama3_8b \
    --batch_sizes=1,32,128 --context=1024 --profile_batch_sizes=1,128 --steps=5 \
    --cache_dir="$out/cache" --output_json="$out/decode_roofline.json"
stage bench_shape 150 needs_gpu $python -m tools.bench_shape --shape=llama3_8b \
    --num_requests=256 --cache_dir="$out/cache" --output_json="$out/bench_shape.json"
stage invariance 70 needs_gpu $python -m tools.invariance_check --shape=smollm2 \
    --cache_dir="$out/cache" --output_json="$out/invariance.json"
finish

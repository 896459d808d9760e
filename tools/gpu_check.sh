#!/usr/bin/env bash
# The prepared GPU check (issue 7): within 8 minutes on a GPU machine with no network.
#
#   tools/gpu_check.sh [OUTPUT_DIR]        # from the repository root; default docs/perf
#
# 1. tests/kernels/test_kernels.py with the kernels compiled (not interpreted) against the references;
# 2. tools.kernel_bench at SmolLM2-135M and Llama-3-8B shapes (random inputs): time, error,
#    decode-attention bandwidth against the measured copy, FFN and prefill FLOP/s;
# 3. tools.tune_pallas: tile sizes, warps and stages of each kernel at Llama-3-8B shapes;
# 4. tools.decode_roofline: the decode step of a random-weight Llama-3-8B-shaped model at
#    batch 1, 32 and 128 (context 1024) against weights + KV bytes over the copy bandwidth.
# Each stage has its own time limit, so one that hangs does not take the others' time. Needs
# jax (with its CUDA plugin), flax, numpy, absl-py and pytest; the repository is imported from
# the working tree (nothing is installed).
set -uo pipefail
out=${1:-docs/perf}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=python3
status=0

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - start))s; tail of $out/$name.txt:"
    tail -n 25 "$out/$name.txt"
    [ "$rc" -eq 0 ] || status=1
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    $python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
    git rev-parse HEAD 2>/dev/null || true
} > "$out/gpu_env.txt" 2>&1
cat "$out/gpu_env.txt"

stage gpu_kernel_tests 180 $python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py
stage kernel_bench 90 $python -m tools.kernel_bench --shapes=smollm2,llama3_8b \
    --output_json="$out/kernel_bench.json"
stage tune_pallas 120 $python -m tools.tune_pallas --shape=llama3_8b --budget_s=90 \
    --output_json="$out/tune_pallas.json"
stage decode_roofline 100 $python -m tools.decode_roofline --shape=llama3_8b \
    --batch_sizes=1,32,128 --context=1024 --output_json="$out/decode_roofline.json"
exit $status

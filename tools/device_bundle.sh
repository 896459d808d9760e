#!/usr/bin/env bash
# What a GPU run needs that the GPU machine lacks, in .device/ (ignored by git), for the
# device tool's `carry` (docs/perf/README.md has the two calls that use it).
#
#   tools/device_bundle.sh          # after the README's main command has fetched the model
#
# - the default model's GGUF, split into parts of at most 48 MiB (a call carries at most
#   64 MiB), with its sha256, reassembled on the machine by the second call;
# - wheels for Python 3.12 of the packages the engine imports that the machine's image lacks
#   (gguf, llguidance), at the versions installed here.
set -euo pipefail
python=.venv/bin/python
cache=$($python -c "from jaxinfer.config import EngineOptions; print(EngineOptions().cache_dir)")
gguf=$(ls "$cache"/models/SmolLM2-135M-Instruct/*.gguf)
rm -rf .device
mkdir -p .device/wheels
split -b 48M -d "$gguf" .device/model.gguf.part
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") |
    awk '{print $1 "  model.gguf"}' > .device/model.gguf.sha256
for package in gguf llguidance; do
    version=$($python -c "import importlib.metadata as m; print(m.version('$package'))")
    $python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/wheels "$package==$version"
done
ls -l .device .device/wheels

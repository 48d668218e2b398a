#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it cannot reach a registry) into .whl/ (git-ignored):
# FlashInfer and its FFI, and pydantic (the GPU image has torch, transformers and safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5
ls .whl

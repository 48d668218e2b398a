#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it cannot reach a registry) into .whl/ (git-ignored):
# FlashInfer and its FFI, pydantic, and the server's FastAPI / uvicorn / pydantic-settings / orjson / httptools / uvloop (the GPU
# image has torch, transformers, safetensors, httpx, anyio, h11, click and prometheus-client), and pytest-xdist for the parallel GPU test stages.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  opentelemetry-api==1.45.2 pytest-xdist==3.8.0 execnet==2.1.2 orjson==3.13.0 \
  httptools==0.9.0 uvloop==0.23.0
ls .whl

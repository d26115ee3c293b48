#!/bin/bash
# Wheels the GPU run (scripts/gpu-run.sh) needs on a GPU host without network beside the offline bundle:
# the OpenTelemetry packages pdserve's proxy imports (and protobuf, used only if the image's is too old),
# pytest with the plugins pyproject.toml configures, for gpu_run.py's e2e step, and gguf, with which
# scripts/gpu-tolerance.sh converts SmolLM2 from its wheel (the image has its other needs). Run it on a
# machine with a network, from the repository root, for the host's CPython 3.12 on x86_64 Linux:
#     bash scripts/gpu-wheels.sh [DIR=dist/gpu-wheels]
set -euo pipefail
dir=${1:-dist/gpu-wheels}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$dir" \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-exporter-http-transport==0.66b2 \
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 protobuf==7.36.2 \
  pytest pluggy iniconfig packaging pygments pytest-timeout pytest-asyncio gguf==0.19.0 \
  2>&1 | grep -v "is ignored" || true
du -sh "$dir"

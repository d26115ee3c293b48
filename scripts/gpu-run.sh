#!/bin/bash
# The GPU run (benchmarks/gpu_run.py says what it measures) on a GPU host without network, from the
# repository root there. First, on a machine with a network, from the repository root:
#     bash scripts/offline-bundle.sh build && bash scripts/gpu-wheels.sh
# and copy dist/offline-bundle and dist/gpu-wheels into the host's clone (docs/gpu.md, "A GPU host without
# network", says how when transfers are limited in size). Then on the host:
#     bash scripts/gpu-run.sh [flags]
#   flags go to gpu_run.py, e.g. --model tiny (quick check), --steps facts,nixl, --pair-ucx default
# Everything it measured lands in $OUT (gpu_run.json, gpu_run.txt, nixl_transfer.json,
# llama3-8b-h200.yaml, logs.tar.gz). GPU_RUN_LIMIT_S=N, if you set it, is your own time box: the whole run,
# the install included, ends within N seconds (for a host or a scheduler slot you hold for so long); steps
# that no longer fit are skipped and recorded so, and what was measured is written before the end. Unset
# (the default), the run has no overall limit.
# GPU_BUNDLE and GPU_WHEELS name other directories than dist/offline-bundle and dist/gpu-wheels.
set -u
start=$SECONDS
limit=${GPU_RUN_LIMIT_S:-}
bundle=${GPU_BUNDLE:-dist/offline-bundle}
wheels=${GPU_WHEELS:-dist/gpu-wheels}
OUT=${OUT:-/tmp/gpu-run-out}
mkdir -p "$OUT"
say() { echo "gpu-run: $*" | tee -a "$OUT/gpu_run.txt"; }

# Keep NVLink multicast off: on a host whose GPUs others share, a program using it can put them out of
# service for a long time.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
env_lines=$(bash scripts/offline-bundle.sh install --from "$bundle") || {
  rc=$?; say "installing the offline bundle failed (exit $rc; 3: a part is missing: stage it)"; exit "$rc"; }
eval "$env_lines"
python3 -c "import vllm, nixl._api; print('vllm', vllm.__version__, 'nixl ok')" || {
  say "vLLM or NIXL does not import from the bundle (see above)"; exit 5; }
say "offline bundle ready in $((SECONDS - start)) s"

# pdserve's own needs that neither the image nor the bundle has: OpenTelemetry (the proxy imports it).
# protobuf only if the image's is too old for opentelemetry-proto: it would shadow the image's otherwise.
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/pdsite \
    $(ls "$wheels"/*.whl | grep -v /protobuf-) 2>&1 | grep -v "is ignored" | tail -3
fi
export PYTHONPATH=$PWD/src:$PYTHONPATH:/tmp/pdsite
if ! python3 -c "import pdserve.proxy.record.otel" 2>/dev/null && ls "$wheels"/protobuf-*.whl >/dev/null 2>&1; then
  say "the image's protobuf is too old for OpenTelemetry: installing the one in $wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pdsite "$wheels"/protobuf-*.whl
fi
python3 -c "import pdserve.proxy.serving.app, pdserve.cli" || say "pdserve does not import here (see above); steps that need it will fail"

if [ -n "$limit" ]; then
  left=$((limit - (SECONDS - start)))
  say "running benchmarks/gpu_run.py with $left s left of GPU_RUN_LIMIT_S=$limit"
  # timeout sends SIGTERM first: the driver then stops the vLLM pair and writes what it has.
  timeout -k 15 "$left" python3 benchmarks/gpu_run.py --out "$OUT" --deadline-s $((left - 25)) "$@"
else
  say "running benchmarks/gpu_run.py (no GPU_RUN_LIMIT_S: no overall limit)"
  python3 benchmarks/gpu_run.py --out "$OUT" "$@"
fi
rc=$?
say "done in $((SECONDS - start)) s (driver exit $rc); files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc

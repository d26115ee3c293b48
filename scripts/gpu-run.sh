#!/bin/bash
# The GPU run of issue 10 on a lent nvidia-h200, as device call 2 of 2 (benchmarks/gpu_run.py says what it
# measures). Build the carries first, on the CPU machine, from the repo root:
#     bash ../shared/gpu/make-carry.sh .gpu && bash scripts/gpu-wheels.sh
# Device call 1: carry [".gpu/p0"], command `bash .gpu/p0/stage.sh`
# Device call 2, within 30 s: carry [".gpu/p1", ".gpu/whl"], command `bash scripts/gpu-run.sh [flags]`
#   flags go to gpu_run.py, e.g. --model tiny (quick check), --steps facts,nixl, --pair-ucx default
# Everything it measured lands in $OUT (gpu_run.json, gpu_run.txt, nixl_transfer.json,
# llama3-8b-h200.yaml, logs.tar.gz). The whole run ends within GPU_RUN_LIMIT_S (default 590) seconds.
set -u
start=$SECONDS
limit=${GPU_RUN_LIMIT_S:-590}
OUT=${OUT:-/tmp/gpu-run-out}
mkdir -p "$OUT"
say() { echo "gpu-run: $*" | tee -a "$OUT/gpu_run.txt"; }

# shellcheck disable=SC1091
source .gpu/p1/unpack.sh || { rc=$?; say "unpacking the vLLM carry failed (exit $rc; 3: redo device call 1)"; exit "$rc"; }
say "carry unpacked and checked in $((SECONDS - start)) s"

# pdserve's own needs that neither the image nor the carry has: OpenTelemetry (the proxy imports it).
# protobuf only if the image's is too old for opentelemetry-proto: it would shadow the image's otherwise.
if [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/pdsite \
    $(ls .gpu/whl/*.whl | grep -v /protobuf-) 2>&1 | grep -v "is ignored" | tail -3
fi
export PYTHONPATH=$PWD/src:$PYTHONPATH:/tmp/pdsite
if ! python3 -c "import pdserve.proxy.tracing" 2>/dev/null && ls .gpu/whl/protobuf-*.whl >/dev/null 2>&1; then
  say "the image's protobuf is too old for OpenTelemetry: installing the carried one"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pdsite .gpu/whl/protobuf-*.whl
fi
python3 -c "import pdserve.proxy.app, pdserve.cli" || say "pdserve does not import here (see above); steps that need it will fail"

left=$((limit - (SECONDS - start)))
say "running benchmarks/gpu_run.py with $left s left"
# timeout sends SIGTERM first: the driver then stops the vLLM pair and writes what it has.
timeout -k 15 "$left" python3 benchmarks/gpu_run.py --out "$OUT" --deadline-s $((left - 25)) "$@"
rc=$?
say "done in $((SECONDS - start)) s (driver exit $rc); files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc

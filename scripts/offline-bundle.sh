#!/usr/bin/env bash
# vLLM + NIXL (and what pdserve needs beside them) for a GPU host without network, as one archive in parts.
#
# On a machine with a network, from the repository root:
#   bash scripts/offline-bundle.sh build [--out DIR] [--part-size SIZE] [--python 3.12]
#        [--requirements FILE] [--wheels-from DIR] [--no-strip] [--level 0-9] [--cache DIR]
# downloads the wheels FILE lists (default scripts/offline-requirements.txt) for the host's Python on
# x86_64 Linux, installs them into one site directory, removes what a dense bf16 Llama on Hopper never
# loads, packs it (tar + xz) and splits it into parts of at most SIZE (split's syntax: 48M, 1G; default:
# one part). DIR (default dist/offline-bundle) then holds the parts, bundle.manifest and this script.
# --wheels-from DIR installs the wheels already in DIR instead of downloading.
#
# On the GPU host, after copying DIR there:
#   bash offline-bundle.sh stage [--to DIR] PART...     # parts that arrive one at a time: keep each as it comes
#   eval "$(bash offline-bundle.sh install [--from DIR ...] [--to DIR])"
# install joins the parts (from each --from DIR, default the script's own, and those staged), checks the
# archive against the manifest, unpacks it into --to (default /tmp/pdserve-offline) once, and prints the
# environment to use it on stdout (also written to TO/env.sh). Exit 3: a part is missing (it says which),
# 4: the joined archive does not match the manifest, 2: bad usage.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
PY=${PYTHON:-python3}
ARCHIVE=site.tar.xz
MANIFEST=bundle.manifest

say() { echo "offline-bundle: $*" >&2; }
die() { say "$1"; exit "${2:-2}"; }

# What a dense bf16 Llama on Hopper (FlashAttention 3) with NIXL over UCX never loads: about 250 MiB of the
# vLLM 0.26 site. Put a line back for a model that needs it: FA2 for fp32, ALiBi or odd head sizes (Ampere's
# path too), the MoE kernels for mixture-of-experts models.
strip_site() {
  local site=$1
  rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so     # FA2 (its import is guarded)
  rm -f "$site"/vllm/_moe_C_stable_libtorch.abi3.so          # MoE kernels (import suppressed when absent)
  rm -f "$site"/vllm/vllm-rs                                 # Rust frontend, only with VLLM_USE_RUST_FRONTEND=1
  rm -f "$site"/vllm/third_party/deep_gemm/_C.cpython-3*-*.so # DeepGEMM (FP8 MoE); install sets VLLM_USE_DEEP_GEMM=0
  rm -rf "$site"/vllm/third_party/fmha_sm100                 # Blackwell attention kernels
  rm -rf "$site"/nixl_ep "$site"/nixl_ep_cu13                # NIXL's expert-parallel part
  rm -rf "$site"/include "$site"/pkgconfig "$site"/bin "$site"/nixl_cu13.scripts
  find "$site" -name __pycache__ -prune -exec rm -rf {} +
}

build() {
  local out=dist/offline-bundle part_size="" pyver=3.12 reqs="" wheels_from="" strip=1 level=9
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-offline
  reqs=$(dirname "$SELF")/offline-requirements.txt
  while [ $# -gt 0 ]; do
    case $1 in
      --out) out=$2; shift 2 ;;
      --part-size) part_size=$2; shift 2 ;;
      --python) pyver=$2; shift 2 ;;
      --requirements) reqs=$2; shift 2 ;;
      --wheels-from) wheels_from=$2; shift 2 ;;
      --no-strip) strip=0; shift ;;
      --level) level=$2; shift 2 ;;
      --cache) cache=$2; shift 2 ;;
      *) die "build: unknown argument $1 (see the top of $SELF)" ;;
    esac
  done
  [[ $level =~ ^[0-9]$ ]] || die "build: --level takes 0-9, not $level"
  local plat=(--only-binary=:all: --python-version "$pyver" --implementation cp)
  for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
  done
  local wheels=$wheels_from
  if [ -z "$wheels" ]; then
    [ -f "$reqs" ] || die "build: no requirements file $reqs"
    wheels=$cache/wheels
    mkdir -p "$wheels"
    say "downloading $(grep -cvE '^\s*(#|$)' "$reqs") wheels for Python $pyver into $wheels"
    "$PY" -m pip download -q --no-deps "${plat[@]}" -d "$wheels" -r "$reqs"
  fi
  compgen -G "$wheels/*.whl" >/dev/null || die "build: no wheels in $wheels"
  work=$(mktemp -d)  # global: the EXIT trap removes it
  trap 'rm -rf "$work"' EXIT
  say "installing $(find "$wheels" -maxdepth 1 -name '*.whl' | wc -l) wheels into one site directory"
  "$PY" -m pip install -q --no-deps --no-index --no-compile "${plat[@]}" --target "$work/site" "$wheels"/*.whl
  [ "$strip" = 1 ] && strip_site "$work/site"
  say "packing $(du -sh "$work/site" | cut -f1) (xz -$level; level 9 takes minutes)"
  tar -C "$work" -cf - site | xz -T0 "-$level" >"$work/$ARCHIVE"
  rm -rf "$out"
  mkdir -p "$out"
  if [ -n "$part_size" ]; then
    split -b "$part_size" -d -a 3 "$work/$ARCHIVE" "$out/$ARCHIVE.part-"
  else
    mv "$work/$ARCHIVE" "$out/$ARCHIVE.part-000"
  fi
  local parts=("$out/$ARCHIVE".part-*)
  {
    echo "# pdserve offline bundle, built $(date -u +%Y-%m-%dT%H:%MZ) for CPython $pyver on x86_64 Linux"
    echo "# from $(basename "$reqs"); join the parts in name order: their sha256 is the archive's"
    echo "parts ${#parts[@]}"
    echo "sha256 $(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)"
  } >"$out/$MANIFEST"
  cp "$SELF" "$out/"
  say "done: ${#parts[@]} part(s) in $out ($(du -sh "$out" | cut -f1)); copy $out to the GPU host, then there:"
  say "  eval \"\$(bash $out/$(basename "$SELF") install)\""
}

stage() {
  local to=/tmp/pdserve-offline files=()
  while [ $# -gt 0 ]; do
    case $1 in
      --to) to=$2; shift 2 ;;
      *) files+=("$1"); shift ;;
    esac
  done
  [ ${#files[@]} -gt 0 ] || die "stage: name the parts (or the directories holding them)"
  mkdir -p "$to/parts"
  local f
  for f in "${files[@]}"; do
    if [ -d "$f" ]; then
      cp "$f"/$ARCHIVE.part-* "$to/parts/" 2>/dev/null || true
      [ -f "$f/$MANIFEST" ] && cp "$f/$MANIFEST" "$to/parts/"
    else
      cp "$f" "$to/parts/"
    fi
  done
  say "staged in $to/parts: $(cd "$to/parts" && ls | tr '\n' ' ')"
}

install() {
  local to=/tmp/pdserve-offline froms=()
  while [ $# -gt 0 ]; do
    case $1 in
      --from) froms+=("$2"); shift 2 ;;
      --to) to=$2; shift 2 ;;
      *) die "install: unknown argument $1 (see the top of $SELF)" ;;
    esac
  done
  [ ${#froms[@]} -gt 0 ] || froms=("$(dirname "$SELF")")
  froms+=("$to/parts")
  local manifest="" d
  for d in "${froms[@]}"; do [ -f "$d/$MANIFEST" ] && manifest=$d/$MANIFEST; done
  [ -n "$manifest" ] || die "install: no $MANIFEST in ${froms[*]}" 3
  local num_parts sha
  num_parts=$(awk '$1 == "parts" {print $2}' "$manifest")
  sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
  if [ "$(cat "$to/site.sha256" 2>/dev/null)" != "$sha" ]; then
    local parts=() missing=() i name found
    for ((i = 0; i < num_parts; i++)); do
      name=$(printf '%s.part-%03d' "$ARCHIVE" "$i")
      found=""
      for d in "${froms[@]}"; do [ -f "$d/$name" ] && { found=$d/$name; break; }; done
      if [ -n "$found" ]; then parts+=("$found"); else missing+=("$name"); fi
    done
    [ ${#missing[@]} -eq 0 ] || die "install: missing ${missing[*]} (looked in ${froms[*]}; stage parts that came earlier)" 3
    say "joining ${#parts[@]} part(s) and checking them"
    [ "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)" = "$sha" ] ||
      die "install: the joined parts do not match $manifest (a part is damaged or from another build)" 4
    rm -rf "$to/site" "$to/site.sha256"
    mkdir -p "$to"
    cat "${parts[@]}" | xz -dc | tar -C "$to" -xf -
    echo "$sha" >"$to/site.sha256"
    say "unpacked into $to/site"
  else
    say "$to/site is already this bundle: not unpacking again"
  fi
  write_env "$to" >"$to/env.sh"
  cat "$to/env.sh"
}

# The environment vLLM needs from the unpacked site on this host, printed for `eval` or `source`.
write_env() {
  local to=$1 libs
  # NIXL's and vLLM's CUDA 13 libraries expect the CUDA runtime the image's torch ships (nvidia/cu13/lib).
  libs=$("$PY" - "$to/site" <<'PY' 2>/dev/null || true
import glob, os, sys
site = os.path.realpath(sys.argv[1])
dirs = [d for p in sys.path if p and os.path.realpath(p) != site for d in sorted(glob.glob(os.path.join(p, "nvidia", "cu1[0-9]", "lib")))]
print(":".join(dict.fromkeys(dirs)))
PY
)
  echo "export PYTHONPATH=$to/site\${PYTHONPATH:+:\$PYTHONPATH}"
  [ -n "$libs" ] && echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  echo "export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not in the bundle; vLLM's sampler would import it"
  echo "export VLLM_USE_DEEP_GEMM=0           # DeepGEMM's kernels are stripped"
  echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network here"
}

case ${1:-} in
  build | stage | install) cmd=$1; shift; "$cmd" "$@" ;;
  *) die "usage: offline-bundle.sh build|stage|install [options] (see the top of $SELF)" ;;
esac

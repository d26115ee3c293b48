"""How fast does NIXL move a KV-sized buffer between two processes, and over which UCX transport?

vLLM's NixlConnector has the decode process READ the prompt's KV from the prefill process. On one H200
(two vLLM processes on it) that moved at 0.5 GB/s over tcp/lo while the GPU copies at 1.8 TB/s; here
READ ran at 0.5 GB/s by default and 0.8-1.2 TB/s with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (2026-12-03,
BENCHMARKS.md "KV transfer and PD latency on one H200"). This reproduces the transfer without vLLM: a
*target* process registers a buffer with NIXL, an *initiator* process READs it (and WRITEs it back), both with the
UCX backend, under several environments. Each setting is a fresh pair of processes, so UCX reads its
variables anew.

Layouts: ``whole`` is one descriptor of the whole buffer; ``blocks`` cuts it into 32 KiB descriptors,
the size of one KV block of one layer for Llama-3-8B (16 tokens x 8 KV heads x 128 x bf16), which is
how vLLM describes a transfer. Also measured, as the ceiling: torch's own CUDA IPC between two
processes and a device-to-device copy inside one.

    python3 benchmarks/nixl_transfer.py --out DIR [--mem vram|dram] [--settings NAME,...] [--mib 256]

Needs torch and nixl importable (the engine venv, or the offline bundle unpacked on a GPU host without
network); imports no pdserve. Writes DIR/nixl_transfer.json (every figure) and DIR/nixl-<setting>.log
(each pair's output, UCX's protocol choices included: UCX_PROTO_INFO=y) and prints one line per figure.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import add_numbers, print_result, read_result, script_parser

BLOCK_BYTES = 32 * 1024
_PAIR_TIMEOUT_S = 90.0
_WAIT_S = 60.0

# name -> (extra environment, memory kinds it applies to). Every setting also gets UCX_PROTO_INFO=y.
# Why each: "default" is what vLLM got. UCX disables cuda_ipc GET (= NIXL READ) when NVML shows no
# NVLink on GPU 0 (uct_cuda_ipc_iface_get_max_get_zcopy: "cuda-ipc get zcopy disabled as no nvlinks
# detected") unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y; a lone H200 has no NVLink peer, so READ falls back
# to a software GET over tcp while WRITE (PUT) may still take cuda_ipc. The rest vary what the earlier
# run varied (UCX_TLS, RNDV) and what else can steer the choice (memtype cache, protocol v1).
SETTINGS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    # Most telling first: the budget may end the list early.
    "default": ({}, ("vram", "dram")),
    "get-zcopy-on": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, ("vram",)),
    # Without UCX's IPC mapping cache an importer unmaps the peer's memory after each operation, so a dead
    # exporter's GPU memory is freed at once (benchmarks/gpu_restart.py); what does a READ pay for it?
    "get-zcopy-on-cache-off": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_CUDA_IPC_CACHE": "n"}, ("vram",)),
    "debug-log": ({"UCX_LOG_LEVEL": "debug"}, ("vram",)),  # confirms the reason in UCX's own words
    "tls-ipc-copy-tcp+get-zcopy": (
        {"UCX_TLS": "cuda_ipc,cuda_copy,tcp", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
        ("vram",),
    ),
    "tls-ipc-copy-tcp": ({"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}, ("vram",)),
    "proto-emulation-off": ({"UCX_PROTO_EMULATION_ENABLE": "n"}, ("vram",)),  # no software GET over AM
    "proto-v1": ({"UCX_PROTO_ENABLE": "n"}, ("vram",)),
    "rndv-get-zcopy": ({"UCX_RNDV_SCHEME": "get_zcopy"}, ("vram",)),
    "tls-all": ({"UCX_TLS": "all"}, ("vram",)),
    "memtype-cache-off": ({"UCX_MEMTYPE_CACHE": "n"}, ("vram",)),
    "tls-sm-tcp": ({"UCX_TLS": "sm,self,tcp"}, ("dram",)),  # kv_buffer_device cpu: host memory
    "tls-tcp": ({"UCX_TLS": "tcp"}, ("dram",)),
}
DEFAULT_SETTINGS = ",".join(SETTINGS)


def _log(text: str) -> None:
    print(text, flush=True)


def _device(mem: str) -> str:
    return "cuda" if mem == "vram" else "cpu"


def _pattern(num_bytes: int, seed: int, mem: str) -> Any:
    import torch

    device = _device(mem)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device, generator=gen)


def _sync(mem: str) -> None:
    if mem == "vram":
        import torch

        torch.cuda.synchronize()


def _wait_file(path: Path, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.02)
    return path.read_bytes()


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)  # the peer never reads half a file


def _agent_with_buffer(
    name: str, backend: str, rdv: Path, mem: str, num_bytes: int, seed: int
) -> tuple[Any, Any, int]:
    """A NIXL agent with a buffer of the pattern ``seed`` registered, its metadata published for the peer:
    (agent, buffer, the device id its descriptors name: the buffer's GPU, 0 for host memory)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
    buf = _pattern(num_bytes, seed=seed, mem=mem)
    _sync(mem)
    agent.register_memory(buf)
    _publish(rdv / f"{name}.meta", agent.get_agent_metadata())
    return agent, buf, max(buf.get_device(), 0)


def _descs(base: int, num_bytes: int, chunk: int, device_id: int) -> list[tuple[int, int, int]]:
    return [(base + off, min(chunk, num_bytes - off), device_id) for off in range(0, num_bytes, chunk)]


def run_target(rdv: Path, mem: str, num_bytes: int, backend: str) -> int:
    """Hold a buffer with a known pattern; after the initiator's WRITEs, check what it wrote."""
    agent, buf, device_id = _agent_with_buffer("target", backend, rdv, mem, num_bytes, seed=1)
    _publish(rdv / "target.json", json.dumps({"addr": buf.data_ptr(), "device": device_id}).encode())
    agent.add_remote_agent(_wait_file(rdv / "initiator.meta", _WAIT_S))
    deadline = time.monotonic() + _PAIR_TIMEOUT_S
    while time.monotonic() < deadline:
        notifs = agent.get_new_notifs()
        if any(msg == b"done" for msgs in notifs.values() for msg in msgs):
            break
        time.sleep(0.005)
    else:
        _publish(rdv / "target.result", json.dumps({"error": "no 'done' from the initiator"}).encode())
        return 1
    _sync(mem)
    expected = _pattern(num_bytes, seed=2, mem=mem)
    ok = bool((buf == expected).all().item())
    _publish(rdv / "target.result", json.dumps({"write_data_ok": ok}).encode())
    return 0


def _timed(agent: Any, handle: Any, timeout: float) -> float:
    started = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"transfer not done after {timeout:.0f} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"transfer ended in state {state}")
    return time.perf_counter() - started


def run_initiator(rdv: Path, mem: str, num_bytes: int, backend: str, reps: int) -> int:
    """READ the target's buffer (then WRITE a second pattern into it), per layout; print one JSON."""
    agent, buf, device_id = _agent_with_buffer("initiator", backend, rdv, mem, num_bytes, seed=0)
    remote = agent.add_remote_agent(_wait_file(rdv / "target.meta", _WAIT_S))
    info = json.loads(_wait_file(rdv / "target.json", _WAIT_S))
    kind = mem.upper()
    results: list[dict[str, Any]] = []
    for op in ("READ", "WRITE"):
        if op == "WRITE":  # what the target checks at the end
            buf.copy_(_pattern(num_bytes, seed=2, mem=mem))
            _sync(mem)
        for layout, chunk in (("whole", num_bytes), ("blocks", BLOCK_BYTES)):
            entry: dict[str, Any] = {"op": op, "layout": layout, "descriptors": -(-num_bytes // chunk)}
            try:
                local = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _descs(buf.data_ptr(), num_bytes, chunk, device_id), kind
                )
                far = agent.prep_xfer_dlist(
                    remote, _descs(info["addr"], num_bytes, chunk, info["device"]), kind
                )
                indices = list(range(entry["descriptors"]))
                handle = agent.make_prepped_xfer(op, local, indices, far, indices)
                entry["backend"] = agent.query_xfer_backend(handle)
                first = _timed(agent, handle, 120.0)  # warm-up: connection, rkey unpack, IPC mapping
                if op == "READ":
                    _sync(mem)
                    entry["read_data_ok"] = bool((buf == _pattern(num_bytes, seed=1, mem=mem)).all().item())
                times = [_timed(agent, handle, 60.0) for _ in range(reps)]
                entry |= {"first_s": first, "times_s": times}
                entry["gb_per_s"] = num_bytes / statistics.median(times) / 1e9
                entry["best_gb_per_s"] = num_bytes / min(times) / 1e9
            except Exception as exc:  # one failing layout must not hide the others
                entry["error"] = f"{type(exc).__name__}: {exc}"
            results.append(entry)
    agent.send_notif(remote, b"done")
    print_result(results)
    time.sleep(0.5)  # let the notification leave before the agent is torn down
    return 0


def run_torch_ipc(num_bytes: int, reps: int) -> int:
    """The ceiling on one GPU: torch's CUDA IPC between two processes, and a copy within one."""
    import torch
    import torch.multiprocessing as mp

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    out: dict[str, Any] = {}
    out["d2d_copy_gb_per_s"] = num_bytes / _copy_s(dst, src, reps) / 1e9  # bytes moved, not r+w
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    for name, (a, b) in {"d2h_pinned": (host, src), "h2d_pinned": (src, host)}.items():
        out[f"{name}_gb_per_s"] = num_bytes / _copy_s(a, b, reps, non_blocking=True) / 1e9
    ctx = mp.get_context("spawn")
    queue, answer = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(queue, answer, reps))
    child.start()
    queue.put(src)  # torch sends a CUDA IPC handle, not the bytes
    try:
        out |= answer.get(timeout=_PAIR_TIMEOUT_S)
    finally:
        queue.put(None)
        child.join(timeout=10)
    print_result(out)
    return 0


def _ipc_child(queue: Any, answer: Any, reps: int) -> None:
    import torch

    remote = queue.get()
    local = torch.empty_like(remote)
    seconds = _copy_s(local, remote, reps)
    ok = bool((local == 7).all().item())
    answer.put({"torch_ipc_read_gb_per_s": remote.numel() / seconds / 1e9, "torch_ipc_ok": ok})
    queue.get()  # hold the mapping until the parent is done


def _copy_s(dst: Any, src: Any, reps: int, non_blocking: bool = False) -> float:
    """Median seconds of ``reps`` copies of ``src`` into ``dst``, each timed between two device syncs,
    after one more that warms up (and is not counted)."""
    import torch

    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


_UCX_PREFIX = re.compile(r"^\[[0-9.]+\] \[[^\]]+\]\s*")
_REASONS = re.compile(
    r"nvlink|get zcopy|cuda_ipc.*(disabled|unreachable|not supported|failed)|MNNVL|PID namespace", re.I
)


def _protocol_lines(text: str) -> list[str]:
    """UCX_PROTO_INFO's tables for remote memory access (what NIXL READ/WRITE use), one line each:
    the operation, the memory types, and which transport moves which sizes; plus any line in which UCX
    gives a reason about cuda_ipc or NVLink (with UCX_LOG_LEVEL=debug)."""
    out: list[str] = []
    rows: list[str] = []
    title = cfg = ""
    for raw in text.splitlines():
        line = _UCX_PREFIX.sub("", raw).strip()
        if _REASONS.search(line) and not line.startswith("|"):
            out.append(line[:240])
        if not line.startswith("|"):
            if line.startswith("+") and title and rows:
                if "remote memory" in title:
                    out.append(f"{title} [{cfg}]: " + "; ".join(rows))
                title, rows = "", []
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # "target self cfg#0", then the operation's title
            if cells[0].startswith(("target", "self", "intra", "inter")) and not title:
                cfg, rows = cells[0], []
            else:
                title = cells[0]
        elif cells[:1] != ["Range"] and len(cells) == 3:
            rows.append(" ".join(cells))
    return list(dict.fromkeys(out))[:60]  # each table is printed once per endpoint: keep one


def run_pair(
    setting: str, mem: str, num_bytes: int, reps: int, out_dir: Path, backend: str
) -> dict[str, Any]:
    extra_env, _ = SETTINGS[setting]
    env = {**os.environ, "UCX_PROTO_INFO": "y", **extra_env}
    with tempfile.TemporaryDirectory(prefix="nixl-bench-") as tmp:
        rdv = Path(tmp)
        common = [
            sys.executable,
            __file__,
            "--rendezvous",
            str(rdv),
            "--mem",
            mem,
            "--mib",
            str(num_bytes >> 20),
        ]
        common += ["--backend", backend, "--reps", str(reps)]
        log_path = out_dir / f"nixl-{setting}-{mem}.log"
        record: dict[str, Any] = {"setting": setting, "mem": mem, "env": extra_env, "log": log_path.name}
        started = time.monotonic()
        with open(log_path, "wb") as log:
            target = subprocess.Popen(
                [*common, "--role", "target"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                initiator = subprocess.run(
                    [*common, "--role", "initiator"], env=env, capture_output=True, timeout=_PAIR_TIMEOUT_S
                )
                text = initiator.stdout.decode(errors="replace") + initiator.stderr.decode(errors="replace")
                log.write(b"\n===== initiator =====\n" + text.encode())
                results = read_result(text)
                record["results"] = [] if results is None else results
                if results is None:
                    record["error"] = f"initiator exited {initiator.returncode} without a result"
                target.wait(timeout=15)
                result_file = rdv / "target.result"
                if result_file.exists():
                    record |= json.loads(result_file.read_bytes())
            except subprocess.TimeoutExpired as exc:
                record["error"] = f"timed out: {exc}"
            finally:
                if target.poll() is None:
                    target.kill()
        record["seconds"] = round(time.monotonic() - started, 1)
        log_text = log_path.read_text(errors="replace")
        record["ucx_lines"] = _protocol_lines(log_text)
        if len(log_text) > 4_000_000:  # a debug log can be huge; keep its head and what we grep for
            log_path.write_text(log_text[:200_000] + "\n...\n" + "\n".join(record["ucx_lines"]))
    return record


def _describe(record: dict[str, Any]) -> list[str]:
    lines = []
    for r in record.get("results", []):
        figure = (
            f"{r['gb_per_s']:8.2f} GB/s (best {r['best_gb_per_s']:.2f})"
            if "gb_per_s" in r
            else r.get("error", "?")
        )
        check = "" if r.get("read_data_ok", True) else "  DATA WRONG"
        lines.append(
            f"{record['setting']:<28} {record['mem']:<4} {r['op']:<5} {r['layout']:<6} "
            f"{r['descriptors']:>5} descs  {figure}  [{r.get('backend', '-')}]{check}"
        )
    if "error" in record:
        lines.append(f"{record['setting']:<28} {record['mem']:<4} ERROR {record['error']}")
    if record.get("write_data_ok") is False:
        lines.append(f"{record['setting']:<28} {record['mem']:<4} WRITE DATA WRONG")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument(
        "--role",
        choices=("orchestrate", "target", "initiator", "torch-ipc", "plugins"),
        default="orchestrate",
    )
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--rendezvous", type=Path)
    p.add_argument("--mem", default="vram,dram", help="vram, dram or both (comma-separated)")
    add_numbers(p, {"--mib": 256, "--reps": 3})
    p.add_argument("--backend", default="UCX")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated names from SETTINGS")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new pairs after this long")
    a = p.parse_args(argv)
    num_bytes = a.mib << 20
    if a.role == "target":
        return run_target(a.rendezvous, a.mem, num_bytes, a.backend)
    if a.role == "initiator":
        return run_initiator(a.rendezvous, a.mem, num_bytes, a.backend, a.reps)
    if a.role == "torch-ipc":
        return run_torch_ipc(num_bytes, a.reps)
    if a.role == "plugins":
        return run_plugins()
    a.out.mkdir(parents=True, exist_ok=True)
    mems = a.mem.split(",")
    started = time.monotonic()
    report: dict[str, Any] = {"bytes": num_bytes, "block_bytes": BLOCK_BYTES, "pairs": [], "skipped": []}
    report["backends"] = _run_role("plugins", a.mib)
    _log(f"nixl plugins: {json.dumps(report['backends'])}")
    if "vram" in mems:
        report["torch"] = _run_role("torch-ipc", a.mib)
        _log(f"torch (ceiling): {json.dumps(report['torch'])}")
    for setting in a.settings.split(","):
        for mem in SETTINGS[setting][1]:
            if mem not in mems:
                continue
            if time.monotonic() - started > a.budget_s:
                report["skipped"].append(f"{setting}/{mem}")
                continue
            record = run_pair(setting, mem, num_bytes, a.reps, a.out, a.backend)
            report["pairs"].append(record)
            for line in _describe(record):
                _log(line)
            (a.out / "nixl_transfer.json").write_text(json.dumps(report, indent=1))
    if report["skipped"]:
        _log(f"skipped (budget {a.budget_s:.0f} s spent): {', '.join(report['skipped'])}")
    (a.out / "nixl_transfer.json").write_text(json.dumps(report, indent=1))
    return 0


_STORAGE_BACKENDS = ("GDS", "GDS_MT", "POSIX", "OBJ", "AZURE_BLOB", "GUSLI", "INFINIA", "HF3FS")


def run_plugins() -> int:
    """Which NIXL backends this wheel ships, and whether each transport backend starts here (most need
    NICs: LIBFABRIC wants EFA or verbs, GPUNETIO DOCA). Storage backends move files, not process to
    process, so they are listed, not started (some would try to reach a cloud endpoint)."""
    from nixl._api import nixl_agent, nixl_agent_config

    probe = nixl_agent("probe", nixl_agent_config(backends=[]))
    found: dict[str, str] = {}
    for name in probe.get_plugin_list():
        if name in _STORAGE_BACKENDS:
            found[name] = "storage backend (not a transport; not started)"
            continue
        try:
            probe.create_backend(name)
            found[name] = "starts: " + ",".join(probe.get_backend_mem_types(name))
        except Exception as exc:
            found[name] = f"fails: {str(exc)[:160]}"
    print_result(found)
    return 0


def _run_role(role: str, mib: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        proc = subprocess.run([sys.executable, __file__, "--role", role, "--mib", str(mib)],
                              capture_output=True, text=True, timeout=_PAIR_TIMEOUT_S, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"{role} timed out after {_PAIR_TIMEOUT_S:.0f} s"}
    result: dict[str, Any] | None = read_result(proc.stdout)
    return {"error": (proc.stdout + proc.stderr)[-2000:]} if result is None else result


if __name__ == "__main__":
    sys.exit(main())

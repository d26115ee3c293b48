"""What an instance's log says that its HTTP API does not: dtype, tensor-parallel size, KV layout, NIXL
backend, UCX lanes, engine ids (one per start), handshakes and engine replacements.

Pure parsing of the text `pdserve up` writes per instance (engines/launcher.py: a ``# pdserve:`` header
with the command and the env pdserve set, then vLLM's own output; a restart appends another header).
Every pattern below is a line vLLM 0.32 / NIXL 1.5 / UCX print, seen in a real log or read in the
installed source (docs/vllm.md). A line that is not there leaves its fact ``None``: unknown, not wrong.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from pdserve.events import LATE_PULL_LINE

HEADER: Final = "# pdserve: "  # engines/launcher.py, once per (re)start
ENV_HEADER: Final = "# env: "
_ACCESS_LINE: Final = "INFO:     "  # uvicorn's access log: a line per health check and scrape

_ENGINE_CONFIG = re.compile(
    r"Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config: (?P<config>.*)"
)
_DTYPE = re.compile(r"(?:^|, )dtype=(?:torch\.)?(?P<v>\w+)")
_KV_DTYPE = re.compile(r"kv_cache_dtype=(?P<v>\w+)")
_TP = re.compile(r"tensor_parallel_size=(?P<v>\d+)")
_LAYOUT = re.compile(r"Detected kv cache layout (?P<v>\w+)")
_ATTN = re.compile(r"Detected attention backend\(s\) \[(?P<v>[^\]]*)\]")
_WORKER = re.compile(r"Initializing NIXL worker (?P<v>[0-9a-f-]{36})")
_NIXL_BACKEND = re.compile(r"Backend (?P<v>\w+) was instantiated")
# Both spellings: the JSON of --kv-transfer-config in the header, the KVTransferConfig repr vLLM logs.
_BUFFER_DEVICE = re.compile(r"""kv_buffer_device["']?\s*[:=]\s*["'](?P<v>\w+)["']""")
_KV_ROLE = re.compile(r"""kv_role["']?\s*[:=]\s*["'](?P<v>\w+)["']""")
_CONNECTOR_BACKENDS = re.compile(r"""["']backends["']\s*:\s*\[(?P<v>[^\]]*)\]""")
_UCX_SET = re.compile(r"Setting (?P<k>UCX_\w+) to '(?P<v>[^']*)'")
_UCX_ENV = re.compile(r"UCX_\* env variables?: (?P<v>.*)")
_COMPAT = re.compile(r"NIXL compatibility check passed \(hash: (?P<v>\w+)\)")
_CHANGED = re.compile(r"Remote engine at (?P<at>\S+) changed from (?P<old>[0-9a-f-]+) to (?P<new>[0-9a-f-]+)")
_FAILURE = re.compile(r"NIXL transfer failure: (?P<v>\w+)")
# Prefill, counted at its next step after the fact (docs/vllm-kv-lifecycle.md §2): a pull of released KV.
_LATE_PULL = re.compile(re.escape(LATE_PULL_LINE) + r"(?P<v>\S+) were retrieved")
_LANE = re.compile(
    r"\b[a-z][a-z0-9_]*/[\w:.\-]+"
)  # a UCX transport/device: tcp/lo, cma/memory, cuda_ipc/cuda


@dataclass(frozen=True)
class UcxLane:
    """One row of a UCX_PROTO_INFO table: for this operation and message size, UCX uses this lane."""

    operation: str  # e.g. "remote memory read by ucp_get*(multi) into host memory from host"
    locality: str  # "self" (an agent to itself), "intra-node" or "inter-node"
    sizes: str  # e.g. "0..inf"
    protocol: str  # e.g. "zero-copy"
    lane: str  # transport/device, e.g. "tcp/lo"


@dataclass(frozen=True)
class LogFacts:
    path: str
    num_starts: int  # headers seen: 1 + the restarts pdserve appended to this log
    command: str | None = None  # the last start's command line
    port: int | None = None  # --port of the last start
    host: str | None = None
    engine_ids: tuple[str, ...] = ()  # NIXL engine id of each start, oldest first
    vllm_version: str | None = None
    dtype: str | None = None  # the model's compute dtype as the engine resolved it
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int | None = None
    kv_layout: str | None = None  # as the NixlConnector resolved it (cache_config_info says None)
    attention_backends: str | None = None
    kv_buffer_device: str | None = None
    kv_role: str | None = None  # kv_producer, kv_consumer or kv_both
    nixl_backends: tuple[str, ...] = ()  # NIXL backends instantiated (UCX unless configured)
    ucx_env: dict[str, str] = field(default_factory=dict)  # UCX_* pdserve, vLLM or UCX itself named
    ucx_lanes: tuple[UcxLane, ...] = ()  # only when the instance ran with UCX_PROTO_INFO=y
    compat_hashes: tuple[str, ...] = ()  # one per handshake decode made
    engine_changes: tuple[tuple[str, str, str], ...] = ()  # (host:port, old id, new id), decode side
    transfer_failures: dict[str, int] = field(default_factory=dict)  # failure type → count
    late_pulls: tuple[str, ...] = ()  # remote_request_ids prefill saw pulled after it released them

    @property
    def engine_id(self) -> str | None:
        return self.engine_ids[-1] if self.engine_ids else None


def _flag(command: str, name: str) -> str | None:
    match = re.search(rf"(?:^|\s){re.escape(name)}[ =](\S+)", command)
    return match.group(1) if match else None


def _env_of(header_line: str) -> dict[str, str]:
    try:
        env = ast.literal_eval(header_line[len(ENV_HEADER) :].strip())
    except (ValueError, SyntaxError):
        return {}
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def _cells(line: str) -> list[str] | None:
    """The cells of a UCX table row (``| a | b | c |``, maybe behind UCX's log prefix), else None."""
    start, end = line.find("|"), line.rfind("|")
    if start == -1 or end <= start:
        return None
    return [c.strip() for c in line[start + 1 : end].split("|")]


def parse_log(lines: Iterable[str], path: str = "") -> LogFacts:
    """The facts of the log's last start (config, layout, transport) and of its whole life (engine ids,
    handshakes, replacements, failures)."""
    num_starts = 0
    command: str | None = None
    last: dict[str, str] = {}
    ucx_env: dict[str, str] = {}
    engine_ids: list[str] = []
    backends: list[str] = []
    lanes: list[UcxLane] = []
    hashes: list[str] = []
    changes: list[tuple[str, str, str]] = []
    failures: dict[str, int] = {}
    late: list[str] = []
    operation = locality = ""
    for line in lines:
        if line.startswith(_ACCESS_LINE):  # most of a long-running log: skip without a regex
            continue
        line = line.rstrip("\n")
        if line.startswith(HEADER):
            # A restart: what the earlier start said about config and transport no longer holds.
            num_starts += 1
            command = line[len(HEADER) :]
            last, backends, lanes, operation, locality = {}, [], [], "", ""
            ucx_env = {}
        for key, pattern in (
            ("kv_buffer_device", _BUFFER_DEVICE),
            ("kv_role", _KV_ROLE),
            ("backends", _CONNECTOR_BACKENDS),
        ):
            if key not in last and (found := pattern.search(line)) is not None:
                last[key] = found.group("v")
        if line.startswith(HEADER):
            continue
        if line.startswith(ENV_HEADER):
            ucx_env.update({k: v for k, v in _env_of(line).items() if k.startswith("UCX_")})
            continue
        if (m := _ENGINE_CONFIG.search(line)) is not None:
            last["version"] = m.group("version")
            config = m.group("config")
            for key, pattern in (("dtype", _DTYPE), ("kv_cache_dtype", _KV_DTYPE), ("tp", _TP)):
                if (found := pattern.search(config)) is not None:
                    last[key] = found.group("v")
        elif (m := _LAYOUT.search(line)) is not None:
            last["layout"] = m.group("v")
        elif (m := _ATTN.search(line)) is not None:
            last["attention"] = m.group("v").replace("'", "")
        elif (m := _WORKER.search(line)) is not None:
            if not engine_ids or engine_ids[-1] != m.group("v"):
                engine_ids.append(m.group("v"))
        elif (m := _NIXL_BACKEND.search(line)) is not None:
            if m.group("v") not in backends:
                backends.append(m.group("v"))
        elif (m := _UCX_SET.search(line)) is not None:
            ucx_env[m.group("k")] = m.group("v")
        elif (m := _UCX_ENV.search(line)) is not None:
            for item in m.group("v").split():
                key, _, value = item.partition("=")
                ucx_env[key] = value
        elif (m := _COMPAT.search(line)) is not None:
            hashes.append(m.group("v"))
        elif (m := _CHANGED.search(line)) is not None:
            changes.append((m.group("at"), m.group("old"), m.group("new")))
        elif (m := _FAILURE.search(line)) is not None:
            failures[m.group("v")] = failures.get(m.group("v"), 0) + 1
        elif (m := _LATE_PULL.search(line)) is not None:
            late.append(m.group("v"))
        elif (cells := _cells(line)) is not None:
            # UCX_PROTO_INFO tables: a "<context> <locality> cfg#N" row, the operation's row, a
            # "Range | Description | Config" row, then one row per message-size range.
            if len(cells) == 1 and "cfg#" in cells[0]:
                locality, operation = _locality(cells[0]), ""
            elif len(cells) == 1 and locality and not operation:
                operation = cells[0]
            elif len(cells) >= 3 and operation and cells[0] != "Range":
                for lane in _LANE.findall(cells[-1]):
                    lanes.append(UcxLane(operation, locality, cells[0], cells[-2], lane))
    if not backends and last.get("backends"):
        backends = [b.strip().strip("'\"") for b in last["backends"].split(",") if b.strip()]
    port = _flag(command, "--port") if command else None
    return LogFacts(
        path=path,
        num_starts=num_starts,
        command=command,
        port=int(port) if port and port.isdigit() else None,
        host=_flag(command, "--host") if command else None,
        engine_ids=tuple(engine_ids),
        vllm_version=last.get("version"),
        dtype=last.get("dtype"),
        kv_cache_dtype=last.get("kv_cache_dtype"),
        tensor_parallel_size=int(last["tp"]) if "tp" in last else None,
        kv_layout=last.get("layout"),
        attention_backends=last.get("attention"),
        kv_buffer_device=last.get("kv_buffer_device"),
        kv_role=last.get("kv_role"),
        nixl_backends=tuple(backends),
        ucx_env=ucx_env,
        ucx_lanes=tuple(lanes),
        compat_hashes=tuple(hashes),
        engine_changes=tuple(changes),
        transfer_failures=failures,
        late_pulls=tuple(late),
    )


def read_log(path: Path) -> LogFacts:
    with path.open(encoding="utf-8", errors="replace") as f:
        return parse_log(f, str(path))


def _locality(cell: str) -> str:
    return next((w for w in ("intra-node", "inter-node", "self") if f" {w} " in f" {cell} "), "unknown")


def read_lanes(facts: LogFacts) -> list[UcxLane]:
    """The rows UCX chose for reading another process's memory: a NIXL pull is a READ (ucp_get)."""
    return [lane for lane in facts.ucx_lanes if "memory read" in lane.operation and lane.locality != "self"]


def _header_of(path: Path) -> tuple[str | None, str | None]:
    """(host, port) named by the log's first header, read without loading the whole file."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return None, None
    if not first.startswith(HEADER):
        return None, None
    return _flag(first, "--host"), _flag(first, "--port")


_LOOPBACK: Final = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def candidate_logs(url: str, dirs: Sequence[Path]) -> list[Path]:
    """Logs under ``dirs`` (each a run dir, newest dir first) whose header starts a server on ``url``'s
    port and host. Several may match (an earlier run on the same ports): the caller checks which is live."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", str(parts.port or "")
    found: list[Path] = []
    for directory in dirs:
        for path in sorted(directory.glob("*.log")):
            log_host, log_port = _header_of(path)
            is_same_host = (
                log_host == host or (log_host in _LOOPBACK and host in _LOOPBACK) or log_host is None
            )
            if log_port == port and is_same_host:
                found.append(path)
    return found


def run_dirs(explicit: Sequence[str], root: Path = Path("runs"), newest: int = 5) -> list[Path]:
    """Where to look for instance logs: the given run dirs, else the newest few under ./runs (where
    `pdserve up` puts them by default)."""
    if explicit:
        return [Path(d) for d in explicit]
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir()]
    return sorted(dirs, key=lambda d: d.stat().st_mtime, reverse=True)[:newest]

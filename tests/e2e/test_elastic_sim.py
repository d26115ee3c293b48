"""`pdserve up --engine sim --elastic 3`, as a user runs it: three simulated instances of any role behind
an elastic proxy serve completions and chat, streamed and not; long prompts are split (prefill on one
instance, decode pulling the KV on another), short ones served whole, and each split moves KV once.

``--cost-profile none``: the router's rule without step costs (long prompts split), so both decisions
come from a handful of requests; with the simulator's own costs the light load here is best served
colocated (tests/proxy and the cost model's tests cover the planned layouts). Ports 22430-22449 are of
the simulator's tests' range (22000-22499)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from greedy import greedy_text

from pdserve import httpclient
from pdserve.commands.verify import verify, wait_for_transfers
from pdserve.engines.transfers import transfer_counts

PROXY_PORT, FIRST_PORT, FIRST_SIDE_CHANNEL_PORT = 22430, 22431, 22440
LONG_WORDS = 700  # past the router's 512 prompt tokens however the proxy counts them
MODEL = "sim-model"


@dataclass
class Pool:
    url: str
    instances: dict[str, str]  # elastic-0 → its URL, as `up` printed them
    run_dir: Path
    output: str


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    run_dir = tmp_path_factory.mktemp("elastic-sim")
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--engine", "sim", "--elastic", "3", "--cost-profile",
           "none", "--port", str(PROXY_PORT), "--first-port", str(FIRST_PORT), "--first-side-channel-port",
           str(FIRST_SIDE_CHANNEL_PORT), "--run-dir", str(run_dir)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:  # `up` exits (and the loop ends) if it cannot start
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        assert proc.poll() is None, output
        instances = dict(re.findall(r"^\s*elastic\s+(http://\S+)\s.*log (\S+)$", output, re.M))
        names = {Path(log).stem: url for url, log in instances.items()}
        yield Pool(f"http://127.0.0.1:{PROXY_PORT}", names, run_dir, output)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def _prompt(words: int) -> str:
    return f"elastic {uuid.uuid4().hex[:8]}: " + " ".join(["the tide came in over the flats"] * (words // 7))


def _ask(url: str, kind: str, prompt: str, stream: bool, request_id: str | None = None) -> str:
    return greedy_text(url, MODEL, kind, prompt, stream, request_id)


def _placement(pool: Pool, request_id: str) -> dict[str, Any]:
    answer = httpclient.get(f"{pool.url}/requests?id={request_id}", 10)
    assert answer.status == 200, answer.body[:300]
    [record] = answer.json()["requests"]
    placement = record["placement"]
    assert isinstance(placement, dict)
    return placement


def test_up_names_the_pools_instances_and_their_logs_alike(pool: Pool) -> None:
    assert sorted(pool.instances) == ["elastic-0", "elastic-1", "elastic-2"], pool.output
    assert f"proxy    {pool.url}" in pool.output
    for name in pool.instances:
        assert (pool.run_dir / f"{name}.log").is_file()
    # `up`'s doctor checks the pool as a ring: each instance prefills for the next, once.
    urls = sorted(
        line.split()[1] for line in pool.output.splitlines() if line.strip().startswith("elastic  http")
    )
    for a, b in zip(urls, [*urls[1:], urls[0]], strict=True):
        assert f"doctor {a} → {b}: KV" in pool.output, pool.output


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_long_prompts_split_and_short_ones_stay_whole_answering_as_one_instance_alone(
    pool: Pool, kind: str, stream: bool
) -> None:
    alone = next(iter(pool.instances.values()))
    for words, split in ((LONG_WORDS, True), (20, False)):
        prompt, request_id = _prompt(words), f"elastic-sim-{uuid.uuid4().hex[:12]}"
        urls = list(pool.instances.values())
        before = transfer_counts(urls)  # summed over the pool: whichever decoded counts the pull
        text = _ask(pool.url, kind, prompt, stream, request_id)
        placement = _placement(pool, request_id)
        moved = wait_for_transfers(urls, before, expected=1 if split else 0, timeout=5)
        assert text and text == _ask(alone, kind, prompt, stream)
        assert placement["split"] is split, placement
        assert placement["decode_url"] in pool.instances.values()
        if split:
            assert placement["prefill_url"] in pool.instances.values()
            assert placement["prefill_url"] != placement["decode_url"]
        else:
            assert placement["prefill_url"] is None
        assert (moved.successful, moved.failed) == (1 if split else 0, 0), placement


def test_verify_proves_the_pools_split_path_with_prompts_long_enough_to_be_split(pool: Pool) -> None:
    said: list[str] = []
    report = verify(pool.url, say=said.append)
    assert report.ok, "\n".join(report.lines())
    assert any("an elastic pool of 3 instance(s)" in line for line in said), said
    # Every request was split (its record says so) and proved its own transfer.
    assert sum("decode computed 0 of" in what for _, what in report.checks) == 4
    assert not any("served it whole" in what for _, what in report.checks)

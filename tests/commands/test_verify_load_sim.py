"""verify on a slow simulated pair that other clients keep saturated: it waits its turn in decode's
queue, says so, passes and names its own requests; a pair whose decode stops stepping fails with a
stall that names it, not "cannot reach"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve import cli, httpclient
from pdserve.commands.verify import verify
from pdserve.patience import Waiting
from slow_pair import NUM_CLIENTS, SlowPair, heavy_traffic, slow_pair

_PATIENT = Waiting(stall_s=10.0, limit_s=300.0, poll_s=0.2, say_every_s=1.0)


@pytest.fixture
def pair() -> Iterator[SlowPair]:
    with slow_pair() as live:
        yield live


def test_verify_beside_heavy_traffic_waits_its_turn_passes_and_names_its_requests(pair: SlowPair) -> None:
    said: list[str] = []
    with heavy_traffic(pair) as answered:
        report = verify(pair.url, say=said.append, waiting=_PATIENT)
    assert report.ok, "\n".join([*report.lines(), *said])
    assert answered[0] > NUM_CLIENTS
    queued = [line for line in said if "queued behind" in line]
    assert queued and f"at decode {pair.decode} (running 2, waiting" in " ".join(queued), said
    # Its requests by id: announced, listed at the end, and each one found in the proxy's /requests.
    pd_ids = [rid for rid in report.request_ids if rid.count("-") == 2]
    assert len(pd_ids) == 4 and all(f"sending {rid}" in " ".join(said) for rid in pd_ids)
    assert said[-1] == "requests sent: " + ", ".join(report.request_ids)
    for rid in pd_ids:
        listing = httpclient.get(f"{pair.url}/requests?id={rid}", 10).json()
        assert [r["request_id"] for r in listing["requests"]] == [rid]


def test_verify_on_a_decode_that_stopped_stepping_exits_with_a_stall_naming_it(
    pair: SlowPair, capsys: pytest.CaptureFixture[str]
) -> None:
    pair.stall_decode(20)
    code = cli.main(["verify", pair.url, "--stall-after", "3"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.startswith("pdserve: error: verify-") and "stalled: nothing moved for" in err, err
    assert f"decode {pair.decode} (running" in err and "cannot reach" not in out + err
    assert "its requests: X-Request-Id verify-" in out  # named before it waited

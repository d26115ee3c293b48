"""`pdserve top`: the frame from plain snapshots, then `--once` and the live loop against a real proxy in
front of simulated instances."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator

import pytest

from live_proxy import LiveProxy, live_proxy
from pdserve.cli import main
from pdserve.commands.top import InstanceRow, ProxyScrape, Snapshot, _fit, render, run
from pdserve.prometheus import EngineScrape

PREFILL, DECODE = "http://p:1", "http://d:1"
INSTANCES = (InstanceRow("prefill", PREFILL, "serving", "closed", 1),
             InstanceRow("decode", DECODE, "serving", "closed", 2))  # fmt: skip


def snapshot(at: float, xfers: float, num_bytes: float, ok: float, errors: float = 0.0, expired: float = 0.0,
             **changes: object) -> Snapshot:  # fmt: skip
    proxy = ProxyScrape(outcomes={"ok": ok, "error": errors}, retries={"prefill": 1.0}, num_running=3.0,
                        handoffs={"open": 2.0, "issued": ok, "delivered": ok})  # fmt: skip
    engines = {
        PREFILL: EngineScrape(num_running=1, num_waiting=4, kv_usage=0.25, num_transfers=0, num_expired=expired),
        DECODE: EngineScrape(num_running=2, num_waiting=0, kv_usage=0.5, num_transfers=xfers,
                             transfer_seconds=xfers * 0.01, num_bytes=num_bytes, num_failed=0),
    }  # fmt: skip
    fields = {"instances": INSTANCES, "engines": engines, "proxy": proxy, **changes}
    return Snapshot("http://proxy:8000", at, 1_700_000_000.0, **fields)


def row(lines: list[str], first: str) -> list[str]:
    return next(line.split() for line in lines if line.split()[:1] == [first] or first in line.split()[1:2])


def test_first_frame_shows_every_instance_and_says_rates_come_next() -> None:
    lines = render(snapshot(10.0, xfers=10, num_bytes=1e9, ok=10))
    text = "\n".join(lines)
    assert "rates from the next refresh" in text
    assert row(lines, PREFILL)[:7] == ["prefill", PREFILL, "serving", "closed", "1", "1", "4"]
    assert row(lines, DECODE)[:8] == ["decode", DECODE, "serving", "closed", "2", "2", "0", "50.0"]
    assert "requests  -/s" in text and "retries: prefill 1" in text and "handoffs open 2" in text


def test_an_elastic_instance_shows_its_side_and_every_counter_it_moves() -> None:
    """An instance of any role prefills for some requests and pulls for others: its ROLE cell says which
    side the router gives it now, and neither role's counters are blanked."""
    elastic = (InstanceRow("elastic", PREFILL, "serving", "closed", 1, side="prefill"),
               InstanceRow("elastic", DECODE, "serving", "closed", 2, side="decode"))  # fmt: skip
    lines = render(snapshot(10.0, xfers=10, num_bytes=1e9, ok=10, expired=3, instances=elastic))
    assert row(lines, PREFILL)[0] == "elastic/prefill" and row(lines, DECODE)[0] == "elastic/decode"
    assert row(lines, DECODE)[-3:] == ["10", "0", "-"]  # transfers and failures shown; expiries not exported
    assert row(lines, PREFILL)[-1] == "3"  # expired leases


def test_rates_are_deltas_over_the_time_between_refreshes() -> None:
    before = snapshot(10.0, xfers=10, num_bytes=1e9, ok=10)
    now = snapshot(12.0, xfers=30, num_bytes=5e9, ok=30, errors=2, expired=1)
    lines = render(now, before)
    assert "rates over 2.0 s" in lines[0]
    assert "requests  11.0/s" in lines[2]  # 20 ok + 2 errors in 2 s
    assert "error 2 (+2)" in lines[2]  # new failures stand out
    # decode: 20 transfers / 2 s, 4 GB / 2 s, 0.2 s of transfer time / 20 transfers, 30 in all, none failed
    assert row(lines, DECODE)[8:13] == ["10.0", "2.00", "10.0", "30", "0"]
    # prefill: its transfer cells are blank (they move on decode), its expired leases shown
    assert row(lines, PREFILL)[7:] == ["25.0", "1"]
    assert row(lines, "all")[:9] == ["all", "2", "instances", "3", "3", "4", "10.0", "2.00", "30"]


def test_a_restarted_engine_shows_no_rate_rather_than_a_negative_one() -> None:
    lines = render(
        snapshot(12.0, xfers=3, num_bytes=1e8, ok=30), snapshot(10.0, xfers=10, num_bytes=1e9, ok=10)
    )
    assert row(lines, DECODE)[8:11] == ["-", "-", "-"]


def test_an_unreadable_engine_and_an_unhealthy_instance_say_why() -> None:
    sick = InstanceRow("decode", DECODE, "unhealthy", "open", 0, "connection refused")
    now = snapshot(10.0, 0, 0, 0, instances=(INSTANCES[0], sick),
                   engines={PREFILL: EngineScrape(), DECODE: "cannot reach http://d:1/metrics: refused"})  # fmt: skip
    lines = render(now)
    assert row(lines, DECODE)[:6] == ["decode", DECODE, "unhealthy", "open", "0", "?"]
    assert f"! {DECODE} /metrics: cannot reach http://d:1/metrics: refused" in lines
    assert f"! {DECODE} unhealthy: connection refused" in lines


def test_an_unreachable_proxy_is_one_line_not_a_table() -> None:
    lines = render(Snapshot("http://proxy:8000", 1.0, 0.0, proxy_error="cannot reach it"))
    assert lines[-1] == "proxy unreachable: cannot reach it"


def test_a_frame_taller_or_wider_than_the_terminal_is_cut_to_fit() -> None:
    fitted = _fit(["x" * 100] * 50, columns=80, rows=24)
    assert len(fitted) == 23 and all(len(line) <= 80 for line in fitted)
    assert "28 more lines" in fitted[-1]


def test_proxy_metrics_are_grouped_by_outcome_over_endpoints() -> None:
    text = "\n".join([
        'pdserve_requests_total{endpoint="chat",outcome="ok"} 3', 'pdserve_requests_total{endpoint="completions",outcome="ok"} 4',
        'pdserve_kv_handoffs_total{state="abandoned",reason="client_gone"} 1',
        'pdserve_kv_handoffs_total{state="abandoned",reason="decode_refused"} 2',
        'pdserve_kv_handoffs_suspect_total{reason="late"} 1', "pdserve_kv_handoffs_overdue 1",
    ])  # fmt: skip
    scrape = ProxyScrape.parse(text)
    assert scrape.outcomes == {"ok": 7.0}
    assert (scrape.handoffs["abandoned"], scrape.handoffs["suspect"], scrape.handoffs["overdue"]) == (3, 1, 1)


def test_an_elastic_pool_shows_its_layout_placements_and_what_requests_measured() -> None:
    text = "\n".join([
        'pdserve_requests_total{endpoint="completions",outcome="ok"} 128',
        'pdserve_elastic_placements_total{placement="split"} 96', 'pdserve_elastic_placements_total{placement="whole"} 32',
        'pdserve_elastic_layout_info{layout="1P1D"} 1',
        'pdserve_elastic_calibration_factor{kind="whole",metric="ttft"} 13.13',
        'pdserve_elastic_calibration_factor{kind="whole",metric="tpot"} 3.92',
        'pdserve_elastic_calibration_factor{kind="split",metric="ttft"} 15.39',
        'pdserve_elastic_calibration_factor{kind="split",metric="tpot"} 3.0',
    ])  # fmt: skip
    scrape = ProxyScrape.parse(text)
    assert scrape.outcomes == {"ok": 128.0}  # the router's gauges are not taken for the proxy's own
    assert scrape.elastic is not None
    assert scrape.elastic.line() == (
        "elastic   layout 1P1D  placed: split 96  whole 32     "
        "measured/model: whole TTFT x13 TPOT x3.9  split TTFT x15 TPOT x3"
    )
    assert ProxyScrape.parse("pdserve_requests_running 0").elastic is None  # a fixed pool: no such line
    assert scrape.elastic.line() in render(snapshot(10.0, xfers=0, num_bytes=0, ok=128, proxy=scrape))


def test_interval_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        main(["top", "http://127.0.0.1:1", "--interval", "0"])


def test_once_against_an_unreachable_proxy_fails_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "http://127.0.0.1:1", "--once", "--interval", "0.1"]) == 2
    assert "cannot read the proxy" in capsys.readouterr().err


# --- Against a real proxy -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy() -> Iterator[LiveProxy]:
    with live_proxy(num_prefill=2, num_decode=2) as p:
        yield p


def rows_of(text: str, proxy: LiveProxy) -> dict[str, list[str]]:
    return {cells[1]: cells for cells in (line.split() for line in text.splitlines()) if cells[1:2] and cells[1] in
            (*proxy.prefill, *proxy.decode)}  # fmt: skip


def test_once_shows_every_instance_and_the_requests_that_went_through(
    proxy: LiveProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = [int(r[11]) for r in rows_of(_once(proxy, capsys), proxy).values() if r[0] == "decode"]
    for i in range(4):
        proxy.complete(f"once {i}: the quick brown fox jumps over the lazy dog")
    text = _once(proxy, capsys)
    rows = rows_of(text, proxy)
    assert set(rows) == {*proxy.prefill, *proxy.decode}
    for url in proxy.prefill:
        assert rows[url][:5] == ["prefill", url, "serving", "closed", "0"]
        assert rows[url][-1] == "0"  # no lease expired
    decode_rows = [rows[url] for url in proxy.decode]
    assert all(r[:5] == ["decode", r[1], "serving", "closed", "0"] for r in decode_rows)
    # Every request moved its KV once, none failed, and nothing moved while nobody sent anything.
    assert sum(int(r[11]) for r in decode_rows) == sum(counts) + 4
    assert all(r[8:10] == ["0.0", "0.00"] and r[12] == "0" for r in decode_rows)
    assert re.search(r"requests  0\.0/s   ok \d+", text)
    assert "error 0" in text and "suspect 0" in text


def _once(proxy: LiveProxy, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["top", proxy.url, "--once", "--interval", "0.2"]) == 0
    return capsys.readouterr().out


def test_rates_under_load_match_the_requests_sent(proxy: LiveProxy) -> None:
    def traffic(interval_s: float) -> None:
        begun = time.monotonic()
        for i in range(10):
            proxy.complete(f"load {i}: a prompt long enough to fill a few KV blocks " * 4)
        # The rest of the interval idle, so the window (printed to 0.1 s) is long enough to check against.
        time.sleep(max(0.0, interval_s - (time.monotonic() - begun)))

    out = io.StringIO()
    assert run(proxy.url, 1.0, once=True, out=out, pause=traffic) == 0
    text = out.getvalue()
    window = float(re.search(r"rates over ([\d.]+) s", text).group(1))
    request_rate = float(re.search(r"requests  ([\d.]+)/s", text).group(1))
    total = next(line.split() for line in text.splitlines() if line.startswith("all"))
    transfer_rate, gb_per_s = float(total[6]), float(total[7])
    assert request_rate * window == pytest.approx(10, rel=0.15)
    assert transfer_rate == pytest.approx(request_rate, rel=0.05)  # one handoff per request
    assert 0 < gb_per_s < 10  # a sim on loopback: bytes moved, and not absurdly many


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("is_tty", [True, False])
def test_live_view_redraws_in_place_on_a_terminal_and_appends_frames_elsewhere(
    proxy: LiveProxy, is_tty: bool
) -> None:
    out: io.StringIO = _Terminal() if is_tty else io.StringIO()
    frames = 0

    def pause(_: float) -> None:
        nonlocal frames
        frames += 1
        if frames == 3:
            raise KeyboardInterrupt  # Ctrl-C: a clean exit, not a traceback

    assert run(proxy.url, 0.1, out=out, pause=pause) == 0
    text = out.getvalue()
    assert text.count("pdserve top  ") == 3
    if is_tty:
        assert text.count("\x1b[H") == 3 and text.endswith("\x1b[?25h")  # the cursor comes back
    else:
        assert "\x1b[" not in text


def test_an_elastic_pool_says_where_its_factors_come_from() -> None:
    text = "\n".join([
        'pdserve_elastic_layout_info{layout="3 colocated"} 1',
        'pdserve_elastic_calibration_factor{kind="whole",metric="ttft"} 21.0',
        'pdserve_elastic_calibration_factor{kind="whole",metric="tpot"} 4.0',
        'pdserve_elastic_calibration_factor{kind="split",metric="ttft"} 1.0',
        'pdserve_elastic_calibration_factor{kind="split",metric="tpot"} 1.0',
        'pdserve_elastic_calibration_source{kind="whole",source="startup"} 1',
        'pdserve_elastic_calibration_source{kind="split",source="model"} 1',
    ])  # fmt: skip
    scrape = ProxyScrape.parse(text)
    assert scrape.elastic is not None
    assert scrape.elastic.line().endswith(
        "measured/model: whole TTFT x21 TPOT x4 (startup)  split TTFT x1 TPOT x1 (model)"
    )

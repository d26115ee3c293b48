"""`pdserve trace`: one request's phases from the proxy, and the instance log lines that name it."""

from __future__ import annotations

from pathlib import Path

from pdserve.commands.trace import log_lines, render

TRACE = {
    "request_id": "r1", "endpoint": "completions", "stream": True, "outcome": "ok", "trace_id": None,
    "timeline": {"queue_ms": 0.2, "prefill_ms": 40.0, "handoff_gap_ms": 0.5, "decode_first_byte_ms": 12.0,
                 "ttft_ms": 53.1, "e2e_ms": 90.0, "itl_mean_ms": 2.0, "itl_max_ms": 5.0},
    "prefill_url": "http://p:1", "prefill_status": 200, "decode_url": "http://d:1", "decode_status": 200,
    "kv_transfer_params": {"remote_engine_id": "e0", "remote_request_id": "cmpl-r1-0-abcd", "remote_block_ids": [[1, 2]]},
    "retries": ["decode http://d:0: cannot connect"], "error": None, "local_prefill_reason": None,
}  # fmt: skip


def test_every_phase_the_instances_and_the_handoff_are_shown() -> None:
    text = "\n".join(render(TRACE))
    for expected in ("40.0 ms  prefill call", "decode until its first byte", "53.1 ms  arrival until the client's first byte",
                     "engine e0, request cmpl-r1-0-abcd", "retried: decode http://d:0"):  # fmt: skip
        assert expected in text, expected


def test_engine_lines_naming_the_request_or_its_handoff_are_found_in_the_run_logs(tmp_path: Path) -> None:
    (tmp_path / "prefill-0.log").write_text("INFO Received request cmpl-r1-0-abcd\nINFO other\n")
    (tmp_path / "decode-0.log").write_text("WARN Releasing expired KV blocks for request cmpl-r1-0-abcd\n")
    found = list(log_lines(tmp_path, ["r1-0-abcd"]))
    assert [name for name, _ in found] == ["decode-0", "prefill-0"]
    text = "\n".join(render(TRACE, found))
    assert "[decode-0] WARN Releasing expired" in text


def test_an_elastic_pools_placement_is_shown_with_its_reason() -> None:
    placement = {"layout": "2P1D", "split": True, "prefill_url": "http://p:1", "decode_url": "http://d:1",
                 "reason": "2P1D for 3.0 req/s of 2000 in / 128 out"}  # fmt: skip
    text = "\n".join(render({**TRACE, "placement": placement}))
    assert "elastic pool (2P1D): prefill http://p:1, decode http://d:1: 2P1D for 3.0 req/s" in text
    whole = {**placement, "split": False, "prefill_url": None, "reason": "short prompt"}
    assert "elastic pool (2P1D): whole on http://d:1: short prompt" in "\n".join(
        render({**TRACE, "placement": whole})
    )

"""The proxy's own Prometheus ``/metrics``, rendered from live state when scraped.

Nothing here runs per token: the flow bumps two counters per request; everything else (instances,
breakers, queue, KV ledger) is read from ``ProxyState`` and ``Admission`` at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdserve.proxy.pool.backpressure import SHARE, Backpressure
from pdserve.proxy.pool.elastic import ElasticRouter
from pdserve.proxy.pool.holding import Hold
from pdserve.proxy.pool.instance import Instance
from pdserve.proxy.pool.state import ProxyState
from pdserve.proxy.record.timeline import PHASES, Histogram
from pdserve.proxy.serving.admission import Admission


def format_number(value: float) -> str:
    """Exact, as Prometheus reads it: a count stays a whole number however large (``:g`` would print
    1,234,567 requests as 1.23457e+06)."""
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {format_number(value)}")

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for bound, count in h.cumulative():
            self.lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        self.lines.append(f"{name}_sum {format_number(h.sum)}")
        self.lines.append(f"{name}_count {h.count}")


def render(state: ProxyState, admission: Admission) -> str:
    t = _Text()
    stats = state.stats
    t.metric("pdserve_requests_total", "counter", "Requests answered, by endpoint and outcome.",
             (({"endpoint": e, "outcome": o.value}, n) for (e, o), n in sorted(stats.outcomes.items(),
                                                                              key=lambda kv: (kv[0][0], kv[0][1].value))))  # fmt: skip
    t.metric("pdserve_retries_total", "counter", "Attempts retried on another instance, by phase.",
             (({"phase": p}, n) for p, n in sorted(stats.retries.items())))  # fmt: skip
    t.metric("pdserve_decode_prefix_cache_resets_total", "counter",
             "Decode prefix-cache resets after a late KV pull, by result (ok, refused, unavailable, failed).",
             (({"result": r}, n) for r, n in sorted(stats.purges.items())))  # fmt: skip
    t.metric("pdserve_kv_released_after_refusal_total", "counter",
             "Handoffs whose blocks decode was made to pull after it refused the client's request, by "
             "result (ok, refused, failed): prefill frees them then, not when the lease runs out.",
             (({"result": r}, n) for r, n in sorted(stats.releases.items())))  # fmt: skip
    t.metric("pdserve_migrations_total", "counter", "Streams whose decode failed after the client had tokens, "
             "by what followed: ok (went on elsewhere to its end), broken (the continuation failed in turn), "
             "failed (none could begin), ineligible (not one that can go on), exhausted (--max-migrations).",
             (({"result": r}, n) for r, n in sorted(stats.migrations.items())))  # fmt: skip
    t.metric("pdserve_stand_ins_total", "counter", "Requests a prefill instance served whole because no decode "
             "instance was in service.", [({}, stats.num_stand_ins)])  # fmt: skip
    t.metric("pdserve_warmups_total", "counter", "Returning instances that met their peers (a canary handoff "
             "per pair) before taking requests, by result (ok, failed: it serves anyway).",
             (({"result": r}, n) for r, n in sorted(stats.warmups.items())))  # fmt: skip
    t.metric("pdserve_requests_running", "gauge", "Requests holding an admission slot.",
             [({}, admission.num_running)])  # fmt: skip
    t.metric("pdserve_requests_queued", "gauge", "Requests waiting for an admission slot.",
             [({}, admission.num_queued)])  # fmt: skip
    t.metric("pdserve_requests_rejected_total", "counter", "Requests refused for overload (429/503).",
             [({}, admission.num_rejected)])  # fmt: skip
    instances = state.instances
    now = time.monotonic()

    def per_instance(value: Callable[[Instance], float]) -> list[tuple[Mapping[str, str], float]]:
        return [({"role": state.kind_of(i), "url": i.url}, float(value(i))) for i in instances]

    t.metric("pdserve_instance_healthy", "gauge", "1 if the last active health check passed.",
             per_instance(lambda i: i.is_healthy))  # fmt: skip
    t.metric("pdserve_instance_available", "gauge", "1 if the instance takes new requests now.",
             per_instance(lambda i: i.is_available(now)))  # fmt: skip
    t.metric("pdserve_instance_in_flight", "gauge", "Requests the proxy has in flight at the instance.",
             per_instance(lambda i: i.num_in_flight))  # fmt: skip
    t.metric("pdserve_instance_stranded_pushes", "gauge",
             "Pushes a decode may hold KV blocks for that never came (only a restart frees them).",
             per_instance(lambda i: i.num_stranded))  # fmt: skip
    for phase, help_text in PHASES.items():
        t.histogram(f"pdserve_{phase}_seconds", help_text, stats.timings.phases[phase])
    t.histogram("pdserve_itl_seconds", "Gaps between chunks relayed to streaming clients.", stats.timings.itl)
    ledger = state.ledger
    t.metric("pdserve_kv_handoffs_total", "counter", "KV handoffs (prefill params issued), by how they ended.",
             [({"state": "issued"}, ledger.num_issued), ({"state": "delivered"}, ledger.num_delivered),
              *(({"state": "abandoned", "reason": k}, n) for k, n in sorted(ledger.abandoned.items()))])  # fmt: skip
    t.metric("pdserve_kv_handoffs_suspect_total", "counter",
             "Handoffs whose KV may have been released before decode read it, by evidence "
             "(late: past the lease while prefill expired leases; log: prefill's log said so).",
             (({"reason": k}, n) for k, n in sorted(ledger.suspects.items())))  # fmt: skip
    t.metric("pdserve_panic_total", "counter", "Requests sent to an out-of-service instance because "
             "every instance of the role was out (panic mode), by role.",
             (({"role": r}, n) for r, n in sorted(stats.panics.items())))  # fmt: skip
    t.metric("pdserve_kv_handoffs_open", "gauge", "Handoffs whose KV prefill still holds for a decode.",
             [({}, len(ledger.open_handoffs))])  # fmt: skip
    t.metric("pdserve_kv_handoffs_overdue", "gauge", "Open handoffs older than the KV lease.",
             [({}, ledger.num_overdue())])  # fmt: skip
    _backpressure(t, state.backpressure)
    if state.elastic is not None:
        _elastic(t, state.elastic, instances)
    if state.hold is not None:
        _hold(t, state.hold)
    return "\n".join(t.lines) + "\n"


def _backpressure(t: _Text, bp: Backpressure) -> None:
    t.metric("pdserve_decode_wait_waiting", "gauge", "Requests waiting at the proxy, before prefill, for their "
             "decode to renew the KV's lease in time (it steps, and handoffs reach it).", [({}, bp.num_waiting)])  # fmt: skip
    t.metric("pdserve_decode_waits_total", "counter", "Requests that waited for room at their decode, by how the "
             "wait ended (admitted, timed_out: answered 503 at --max-decode-wait, gone: the client left).",
             (({"result": r}, n) for r, n in sorted(bp.results.items())))  # fmt: skip
    t.histogram("pdserve_decode_wait_seconds", "How long requests waited for room at their decode.", bp.waits)
    intakes = bp.intakes
    t.metric("pdserve_decode_handoffs_ahead", "gauge", "Per decode: requests sent toward it (prefilling, or their "
             "KV waiting for it) whose answer has not begun.", [({"url": i.url}, i.num_ahead) for i in intakes])  # fmt: skip
    t.metric("pdserve_decode_expected_pull_seconds", "gauge", "Per decode: how long a handoff sent now would "
             "have its KV go unrenewed (its way to decode's engine, a lease heartbeat's period, the gap between "
             f"decode's steps), as measured; above {SHARE:g} of the KV lease requests wait.",
             [({"url": i.url}, round(i.exposure_s(), 3)) for i in intakes])  # fmt: skip


def _elastic(t: _Text, router: ElasticRouter, instances: Sequence[Instance]) -> None:
    t.metric("pdserve_elastic_placements_total", "counter",
             "Requests the elastic pool's router placed, by placement (split: prefill and decode on two "
             "instances; whole: one instance).",
             (({"placement": k}, n) for k, n in sorted(router.decisions.items())))  # fmt: skip
    t.metric("pdserve_elastic_layout_info", "gauge", "The elastic pool's current layout (its label).",
             [({"layout": router.layout}, 1)])  # fmt: skip
    t.metric("pdserve_elastic_instance_side", "gauge",
             "1 for the side (prefill or decode) the router gives each elastic instance now.",
             [({"url": i.url, "side": side}, 1) for i in instances if (side := router.side(i.url))])  # fmt: skip
    calibration, samples = router.calibration, router.calibration_samples()
    t.metric("pdserve_elastic_calibration_factor", "gauge",
             "Measured over predicted TTFT and TPOT, by kind of placement: the factor the router's cost "
             "model is multiplied by (1 until a kind has measured streams).",
             [({"kind": kind, "metric": metric}, factor)
              for kind in ("whole", "split")
              for metric, factor in zip(("ttft", "tpot"), calibration.factors(kind == "split"), strict=True)])  # fmt: skip
    sources = router.calibration_sources()
    t.metric("pdserve_elastic_calibration_source", "gauge",
             "1 for where each kind's factors come from now: its requests, the start-up measurement, or "
             "the model alone (factors of 1).",
             [({"kind": kind, "source": source}, 1) for kind, source in sources.items()])  # fmt: skip
    t.metric("pdserve_elastic_calibration_samples", "gauge",
             "The streams, by kind of placement, whose measurements calibrate the router now.",
             [({"kind": kind}, n) for kind, n in samples.items()])  # fmt: skip


def _hold(t: _Text, hold: Hold) -> None:
    t.metric("pdserve_elastic_held_total", "counter",
             "Requests the elastic pool held back while every decode-side instance ran the most its TPOT "
             "objective allows (overdue: placed after the hold's limit without room).",
             [({"result": "placed"}, hold.num_held - hold.num_overdue), ({"result": "overdue"}, hold.num_overdue)])  # fmt: skip
    t.metric("pdserve_elastic_held_seconds_total", "counter", "The seconds held requests waited, summed.",
             [({}, hold.held_s)])  # fmt: skip
    t.metric(
        "pdserve_elastic_holding", "gauge", "Requests waiting in the hold now.", [({}, hold.num_waiting)]
    )

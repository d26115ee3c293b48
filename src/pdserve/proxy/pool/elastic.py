"""The elastic pool's router: per request, whole on one instance, or prefill on A and decode on B.

Every instance of an elastic pool can take any role (vLLM decides per request from its
``kv_transfer_params``), so the split is the proxy's choice, made again as the traffic moves:

- every ``replan_s`` the recent arrivals (rate, prompt and output lengths over ``window_s``) go to the
  cost model (costmodel.py, the one `pdserve plan` uses), which ranks every layout of the pool's N
  instances: N colocated, 1P(N-1)D … (N-1)P1D. The best (the most capacity among those that meet the
  SLO, or the lowest latency without one) becomes the pool's layout; a close second does not displace
  it (hysteresis), so the layout moves with the load, not with noise. While the hold keeps requests
  waiting, a layout with less room on its decode side does not displace the current one either: the
  line may block a change, never cause one.
- the layout gives instances roles, softly: an instance leaving the decode side is the one decoding the
  least, one leaving the prefill side the one with the least prefill work waiting, and nothing restarts.
  Requests already running finish where they are.
- each request then goes, under a colocated layout, whole to the instance whose queued prompts end
  soonest (by the step costs); under a split one, its prefill to the prefill-side instance with the
  least prompt work in flight and its decode to the decode-side instance with the fewest requests,
  except that a prompt cheaper to compute than a decode step stays whole on that decode (a split would
  cost more than it saves).
- with a TPOT objective, each decode-side instance runs at most the requests whose steps keep within it
  (``room``: by the step costs, not calibrated, at what it runs and what arrives: batches.py); beyond
  that the proxy holds new requests back (holding.py) rather than slow every stream there past the
  objective. A request goes to the decode-side instance with the most room.
- an instance out of service leaves both sides; with one instance left everything is whole there.
- each stream that ended tells the router what it measured (``done``): measured over predicted, per
  kind of placement, calibrates the next plans (calibrator.py), so a profile of another GPU, or
  instances sharing one, still lead to the layout that meets the SLO here.

Pure: no HTTP, no clock but the one given; the proxy's flow and the simulated cluster
(bench/simcluster.py) both drive it, so the benchmark measures the code that serves.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Literal

from pdserve.configparts import ElasticPool
from pdserve.costmodel import Calibration, Layout, Load, Model, rank_layouts, step_share
from pdserve.proxy.pool import judging
from pdserve.proxy.pool.batches import DecodeBatches
from pdserve.proxy.pool.calibrator import Calibrator
from pdserve.proxy.pool.routing import C, load_score
from pdserve.slo import Slo

Side = Literal["prefill", "decode"]

_HYSTERESIS = 1.05  # the capacity (or slack) a new layout needs over the current one to displace it
_DEFAULT_OUTPUT_LEN = 128  # a request that does not say its max_tokens
_UNPLANNED_SPLIT_TOKENS = 512  # no step costs known: prompts this long are split, shorter ones whole
_CALIBRATION_SAMPLES = 128  # the requests of each kind whose measurements calibrate the model
# Each request is predicted by its own length and queue (``_own``), so the ratios' median is the model's
# bias; their tail is the traffic to come, which the layout's quantiles already count.
_CALIBRATION_QUANTILE = 0.5
_FAST_WINDOW_S = 2.0  # the recent arrivals that may grow the prefill side before the window sees them
_FAST_MIN_ARRIVALS = 10  # fewer in the fast window say nothing
# Arrivals since the last plan past this many times what its rate expected re-plan at once: the plan's
# rate is out of date (the first second of traffic, or a surge), and every request placed meanwhile
# would be predicted, and judged when it measures, at a load that is not the one it meets.
_OUTRUN = 2.0
# The prompts each instance was given (placed at, computed by, tokens), for the streams there to count
# those that landed in their lifetime; more than any stream there outlives.
_PROMPT_LOG = 4096


@dataclass(frozen=True)
class Placement(Generic[C]):
    """Where one request goes: ``prefill`` None means whole on ``decode``."""

    prefill: C | None
    decode: C
    layout: str  # the pool's layout when it was placed ("5P3D", "8 colocated")
    reason: str  # why, in words, for /requests and the trace
    # The model's (TTFT, TPOT) for it before calibration, seconds; None: none to compare a measurement to.
    # Served whole, the TPOT is the step it joins: the prompts that land there in its lifetime are
    # added when it ends (``ElasticRouter.done``), when the router knows which did.
    predicted: tuple[float, float] | None = None
    placed_at: float = 0.0  # the router's clock when it was placed
    step_share_s: float = 0.0  # what it adds to each step of its decode (costmodel.step_share)

    @property
    def is_split(self) -> bool:
        return self.prefill is not None


@dataclass(frozen=True)
class Measured:
    """What a stream measured: arrival to first token, and the mean gap between its tokens (seconds)."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Arrival:
    """A request as the router counted it on arrival (``ElasticRouter.arrive``)."""

    at: float
    input_len: int
    output_len: int


class ElasticRouter:
    """The one owner of the pool's layout, its instances' sides and the work the router has put on each;
    a request's plan tells it when its prefill ends (``prefilled``), the flow when the request ends (``done``)."""

    def __init__(self, settings: ElasticPool, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._arrivals: deque[Arrival] = deque()
        self._first_arrival: float | None = None
        self._layout: Layout | None = None
        self._planned_at = -float("inf")
        self._num_arrived = 0  # since start
        self._arrived_at_plan = 0  # ``_num_arrived`` when the last plan was made
        self._planned_rate = 0.0  # the rate the last plan saw (requests/s)
        self._sides: dict[str, Side] = {}
        self._prefill_tokens: dict[str, int] = {}  # prompt tokens being prefilled there for a split
        self._batches = DecodeBatches(settings.costs, settings.slo.tpot_ms, settings.window_s)
        # When the prompts sent there whole should be computed, by the step costs: a whole request's
        # first token is the flow's to see, not the router's, so its prefill is estimated instead.
        self._prompts_until: dict[str, float] = {}
        # The same for the prompts a prefill-side instance was given to split, by the step costs: what the
        # in-flight count says is queued there, unless the costs say they are computed by now.
        self._prefills_until: dict[str, float] = {}
        self._prompt_log: dict[str, deque[tuple[float, float, int]]] = {}
        self.decisions = {"whole": 0, "split": 0}
        self._calibrator = Calibrator(_CALIBRATION_SAMPLES, _CALIBRATION_QUANTILE)
        self._calibration = Calibration()
        self._max_batch = math.inf  # requests a decode-side instance may run within the TPOT objective
        self._z = 0.0  # the plan's quantile, in standard deviations
        self._whole_below = 0  # a split layout serves prompts this long or shorter whole on a decode

    # --- what the flow calls ----------------------------------------------------------------------

    def arrive(self, prompt_tokens: int, max_tokens: int | None) -> Arrival:
        """Count a request of ``prompt_tokens`` uncached tokens asking ``max_tokens`` into the traffic the
        plans see, when it arrives (a request the proxy holds back is traffic all the same)."""
        now = self._clock()
        output_len = max(2, max_tokens if max_tokens is not None else _DEFAULT_OUTPUT_LEN)
        arrival = Arrival(now, prompt_tokens, output_len)
        self._batches.arrived(now, prompt_tokens, output_len, self._whole_below)
        self._arrivals.append(arrival)
        self._num_arrived += 1
        if self._first_arrival is None:
            self._first_arrival = now
        while self._arrivals and self._arrivals[0].at < now - self._settings.window_s:
            self._arrivals.popleft()
        return arrival

    def place(self, members: Sequence[C], prompt_tokens: int, max_tokens: int | None,
              arrival: Arrival | None = None, waiting: int = 0) -> Placement[C]:  # fmt: skip
        """Where a request of ``prompt_tokens`` uncached tokens asking ``max_tokens`` goes, among the
        instances in service (``members``, at least one); ``arrival``: what ``arrive`` counted for it,
        if it was called (else ``place`` counts it); ``waiting``: the requests the hold keeps back now
        (holding.py), behind this one."""
        if not members:
            raise LookupError("no instance to place a request on")
        if arrival is None:
            arrival = self.arrive(prompt_tokens, max_tokens)
        now = self._clock()
        if now - self._planned_at >= self._settings.replan_s or self._is_outrun(now):
            self._replan(len(members), now, waiting)
        self._assign_sides(members)
        placement = self._choose(members, prompt_tokens)
        share = self._batches.share(prompt_tokens, arrival.output_len, whole=not placement.is_split)
        if share > 0:
            placement = replace(placement, step_share_s=share)
        if placement.predicted is not None:
            placement = replace(placement, predicted=self._own(placement, prompt_tokens, arrival.output_len),
                                placed_at=now)  # fmt: skip
        self._begin(placement, prompt_tokens)
        return placement

    def _is_outrun(self, now: float) -> bool:
        """Whether the arrivals since the last plan outran the rate it planned for (``_OUTRUN``)."""
        since = self._num_arrived - self._arrived_at_plan
        expected = self._planned_rate * (now - self._planned_at) * self._settings.traffic_share
        return since >= _FAST_MIN_ARRIVALS and since > _OUTRUN * expected

    def room(self) -> float:
        """How many more requests the decode side takes before each of its instances runs the most its
        TPOT objective allows (inf: no objective, no plan yet, or no step costs to count with)."""
        if math.isinf(self._max_batch):
            return math.inf
        decodes = [url for url, side in self._sides.items() if side == "decode"]
        if not decodes:
            return math.inf
        return sum(max(0.0, self._cap_at(url) - self._batches.count(url)) for url in decodes)

    def expected_arrivals(self, seconds: float) -> float:
        """The requests this router expects in the next ``seconds``: at the rate its last plan saw (its
        share of the pool's, with several proxy workers), and no more than came in the last ``seconds``,
        so that the estimate ends with the traffic (a plan is made only as requests are placed, and
        a held line may place none for a while)."""
        planned = self._planned_rate * self._settings.traffic_share * seconds
        return min(planned, float(len(self._recent(seconds))))

    def prefilled(self, placement: Placement[C], prompt_tokens: int) -> None:
        """The request's prefill ended (its KV is held for decode, or it failed)."""
        if placement.prefill is not None:
            url = placement.prefill.url
            self._prefill_tokens[url] = max(0, self._prefill_tokens.get(url, 0) - prompt_tokens)

    def done(self, placement: Placement[C], measured: Measured | None = None) -> None:
        """The request ended, whatever the outcome; ``measured``: what it measured, when it streamed
        its answer as placed."""
        self._batches.end(placement.decode.url, placement.step_share_s)
        if measured is not None and placement.predicted is not None:
            ttft, tpot = placement.predicted
            if not placement.is_split:
                tpot += self._stretch(placement, measured)
            if self._calibrator.observe(placement.is_split, measured.ttft_s / ttft if ttft > 0 else math.nan,
                                        measured.tpot_s / tpot if tpot > 0 else math.nan):  # fmt: skip
                self._planned_at = -math.inf  # its first factors: the next request re-plans with them

    def _stretch(self, placement: Placement[C], measured: Measured) -> float:
        """What the prompts its instance computed in a whole stream's lifetime added to each of its steps
        (judging.stretch). Predicted from the plan's traffic instead, streams placed before a wave of
        2,500-token prompts measured two to six times "the model" (the window's mean prompt lags the
        wave), and those ratios ruled colocation out for the chat that came after: the ratio is to be
        the step costs' error, not the traffic's."""
        costs = self._settings.costs
        if costs is None:
            return 0.0
        now = self._clock()
        life = now - placement.placed_at - measured.ttft_s  # its first token to its last
        log = self._prompt_log.get(placement.decode.url, ())
        return judging.stretch(costs, log, placement.placed_at, now, life, measured.tpot_s)

    def measured_alone(self, is_split: bool, prompt_tokens: int, output_len: int, measured: Measured) -> bool:
        """A lone request of ``prompt_tokens`` and ``output_len`` measured ``measured`` at start-up,
        served whole or split on an idle pool: its factors calibrate the kind until the kind's own
        requests count (calibrator.py). False when there are no step costs to compare it to."""
        costs = self._settings.costs
        if costs is None:
            return False
        ttft, tpot = judging.alone(costs, is_split, prompt_tokens, output_len)
        # A TPOT lost in the noise (the longer answer came no later) leaves the model's word for it.
        tpot_ratio = measured.tpot_s / tpot if measured.tpot_s > 0 else 1.0
        if not self._calibrator.prior(is_split, measured.ttft_s / ttft, tpot_ratio):
            return False
        self._calibration = self._calibrator.calibration()
        self._planned_at = -math.inf  # the next request plans with them
        return True

    def forget(self, url: str) -> None:
        """The instance left the pool: its side and counts go with it."""
        for table in (self._sides, self._prefill_tokens, self._prompts_until, self._prefills_until,
                      self._prompt_log):  # fmt: skip
            table.pop(url, None)
        self._batches.forget(url)

    # --- what the routes read ---------------------------------------------------------------------

    @property
    def layout(self) -> str:
        if self._layout is None:
            return "not planned yet"
        return self._layout.describe() + (" (pinned)" if self._settings.num_prefill is not None else "")

    @property
    def calibration(self) -> Calibration:
        """The factors the last plan multiplied the cost model's predictions by."""
        return self._calibration

    def calibration_samples(self) -> dict[str, int]:
        return self._calibrator.num_samples()

    def calibration_sources(self) -> dict[str, str]:
        """Per kind: "requests", "startup" (a start-up measurement's factors) or "model" (none yet)."""
        return self._calibrator.sources()

    def side(self, url: str) -> Side | None:
        return self._sides.get(url)

    def batch(self, url: str) -> dict[str, int | None] | None:
        """What the decode-side instance ``url`` runs for this router and the most it may run now (None:
        no bound), by what it runs and what arrives; None for an instance on the prefill side."""
        if self._sides.get(url) != "decode":
            return None
        most = self._cap_at(url)
        return {"running": self._batches.count(url), "most": None if math.isinf(most) else int(most)}

    def describe(self) -> dict[str, object]:
        load = self._load()
        return {
            "layout": self.layout,
            "load": None if load is None else _describe_load(load),
            "predicted_ttft_ms": None if self._layout is None else _ms(self._layout.ttft_s),
            "predicted_tpot_ms": None if self._layout is None else _ms(self._layout.tpot_s),
            "sides": dict(self._sides),
            "decisions": dict(self.decisions),
            "calibration": {
                **vars(self._calibration),
                "samples": self.calibration_samples(),
                "sources": self._calibrator.sources(),
            },
            "max_requests_per_decode": None if math.isinf(self._max_batch) else round(self._max_batch, 1),
            "decode_batches": {url: self.batch(url) for url, side in self._sides.items() if side == "decode"},
            "whole_below_tokens": self._whole_below,
        }

    # --- deciding ---------------------------------------------------------------------------------

    def _load(self, window_s: float | None = None) -> Load | None:
        """The arrivals of the last ``window_s`` (the settings' window by default) as the cost model's
        load: their rate and mean lengths."""
        window = self._settings.window_s if window_s is None else window_s
        recent = self._recent(window)
        if not recent or self._first_arrival is None:
            return None
        n = len(recent)
        span = self._span(window, n)
        mean_in = sum(a.input_len for a in recent) / n
        cv2 = sum((a.input_len - mean_in) ** 2 for a in recent) / n / mean_in**2 if mean_in > 0 else 0.0
        output_len = max(2, round(sum(a.output_len for a in recent) / n))
        # Each of several proxy workers sees its share of the pool's arrivals and plans for the whole pool.
        return Load(
            n / span / self._settings.traffic_share, max(1, round(mean_in)), output_len, input_cv2=cv2
        )

    def _span(self, window_s: float, num_arrivals: int) -> float:
        """The seconds ``num_arrivals`` of the last ``window_s`` came in. Young traffic is counted over at
        least a re-plan's interval, or one arrival reads as a thousand a second; once enough have come,
        over the time they took: floored at a second, the first plans of 47 req/s read 1, then 10, and
        the requests they placed measured the load's rise as the model's error (factors of 2 that
        ruled colocation out for the rest of the trace)."""
        now = self._clock()
        first = self._first_arrival if self._first_arrival is not None else now
        floor = self._settings.replan_s if num_arrivals < _FAST_MIN_ARRIVALS else 1e-3
        return min(window_s, max(now - first, floor))

    def _recent(self, window_s: float) -> list[Arrival]:
        since = self._clock() - window_s
        return [a for a in self._arrivals if a.at >= since]

    def _replan(self, num_instances: int, now: float, waiting: int) -> None:
        self._planned_at = now
        costs, load = self._settings.costs, self._load()
        self._arrived_at_plan = self._num_arrived
        self._planned_rate = 0.0 if load is None else load.rate
        if costs is None or load is None or num_instances < 2:
            self._layout, self._max_batch = None, math.inf
            return
        slo = self._settings.slo if self._settings.slo.ttft_ms is not None else None
        self._calibration = self._calibrator.calibration()
        ranked = rank_layouts(costs, num_instances, load, slo, self._calibration)
        pinned = self._settings.num_prefill
        keep = min(pinned, num_instances - 1) if pinned is not None else None
        if keep is None and self._layout is not None:
            keep = self._layout.num_prefill
        if pinned is None:
            ranked = self._sooner(ranked, num_instances, slo)
        best, current = ranked[0], next((lay for lay in ranked if lay.num_prefill == keep), None)
        recent = self._recent(self._settings.window_s)
        if current is not None and (
            pinned is not None
            or not _clearly_better(best, current)
            or (
                waiting > 0
                and (current.meets_slo or not best.meets_slo)
                and self._room(best, load, slo, recent) < self._room(current, load, slo, recent)
            )
        ):
            best = current
        self._layout = best
        # Each of several proxy workers counts only the requests it placed, so it takes its share.
        model = Model(costs, load, slo, self._calibration)
        self._z = model.z
        tpot_s = slo.tpot_ms / 1000 if slo is not None and slo.tpot_ms is not None else None
        self._whole_below = judging.cheap_below(costs)
        if best.is_split:
            span = self._span(self._settings.window_s, len(recent))
            self._whole_below = judging.whole_below(
                costs, [a.input_len for a in recent], span * self._settings.traffic_share, best.num_decode,
                model.decode_step_s(best.num_decode, load.rate), tpot_s,
            )  # fmt: skip
        batch = self._cap(best, load, slo, recent) * self._settings.traffic_share
        self._max_batch = max(1.0, math.floor(batch)) if batch < math.inf else math.inf

    def _cap_at(self, url: str) -> float:
        """The most requests the decode-side instance ``url`` runs within the TPOT objective, by what it
        runs and what arrives (batches.py); the plan's cap while it runs none."""
        is_split = self._layout is not None and self._layout.is_split
        return self._batches.cap(url, is_split, self._z, self._settings.traffic_share, self._max_batch)

    def _cap(self, layout: Layout, load: Load, slo: Slo | None, recent: Sequence[Arrival]) -> float:
        """The most requests one of ``layout``'s decode-side instances runs within the TPOT objective, for
        the whole pool (``Model.max_batch``; inf: no objective). The prompts a split layout's decode side
        computes itself (those up to ``_whole_below``) stretch its steps as colocated ones do: its cap
        counts them, or a full batch takes them on top and misses the objective together."""
        costs = self._settings.costs
        assert costs is not None
        whole_tokens = None
        if layout.is_split and recent:
            whole_tokens = sum(a.input_len for a in recent if a.input_len <= self._whole_below) / len(recent)
        return Model(costs, load, slo).max_batch(layout.is_split, whole_tokens)

    def _room(self, layout: Layout, load: Load, slo: Slo | None, recent: Sequence[Arrival]) -> float:
        """The requests ``layout``'s decode side runs at once within the TPOT objective: where the hold's
        line drains. One rule for split and colocated layouts alike. While requests wait, a layout with
        less room makes the line drain slower whatever its capacity promises, since a change moves no
        running stream (seed 5 of the mixed traces, TTFT 300 ms / TPOT 10 ms: 2P2D went to 3P1D with 60
        requests held, and the line grew to 390). The line only blocks a change: read into the ranking
        it swings each second, and the verdict with it (BENCHMARKS.md). Nor does it keep a layout that
        misses the objectives where the new one meets them: the room drains the line into requests that
        are all late (seed 7, TTFT 1 s / TPOT 10 ms: 1P3D's one prefill-side instance under agent bursts
        through their whole phase, 23 req/s where 2P2D with the hold serves 38)."""
        return layout.num_decode * self._cap(layout, load, slo, recent)

    def _sooner(self, ranked: list[Layout], num_instances: int, slo: Slo | None) -> list[Layout]:
        """The layouts as the last seconds' arrivals rank them, where their first has more prefill-side
        instances than ``ranked``'s (the whole window's): a wave of long prompts grows the prefill side
        within seconds; the window, not the wave, shrinks it. The whole ranking, not its first alone:
        the current layout must be judged at the same load, or one that meets the SLO at the window's
        average keeps the pool on it through the wave."""
        costs, fast = self._settings.costs, self._load(_FAST_WINDOW_S)
        if costs is None or fast is None or len(self._recent(_FAST_WINDOW_S)) < _FAST_MIN_ARRIVALS:
            return ranked
        sooner = rank_layouts(costs, num_instances, fast, slo, self._calibration)
        return sooner if sooner[0].num_prefill > ranked[0].num_prefill else ranked

    def _assign_sides(self, members: Sequence[C]) -> None:
        """Give the members the layout's sides, moving as few as possible."""
        urls = [m.url for m in members]
        for url in list(self._sides):
            if url not in urls:
                del self._sides[url]
        want_prefill = self._layout.num_prefill if self._layout is not None else 0
        want_prefill = min(want_prefill, len(urls) - 1)
        for url in urls:
            self._sides.setdefault(url, "decode")
        prefills = [u for u in urls if self._sides[u] == "prefill"]
        decodes = [u for u in urls if self._sides[u] == "decode"]
        while len(prefills) < want_prefill:
            url = min(decodes, key=lambda u: self._batches.count(u))
            decodes.remove(url)
            prefills.append(url)
            self._sides[url] = "prefill"
        while len(prefills) > want_prefill:
            url = min(prefills, key=lambda u: self._prefill_tokens.get(u, 0))
            prefills.remove(url)
            self._sides[url] = "decode"

    def _choose(self, members: Sequence[C], prompt_tokens: int) -> Placement[C]:
        layout = self.layout
        prefill_side = [m for m in members if self._sides.get(m.url) == "prefill"]
        decode_side = [m for m in members if self._sides.get(m.url) == "decode"]
        if self._layout is None and self._settings.costs is None and len(members) > 1:
            # No step costs to plan with: split long prompts over the two least-loaded instances.
            if prompt_tokens >= _UNPLANNED_SPLIT_TOKENS:
                decode = self._least_requests(members)
                prefill = self._least_prefill([m for m in members if m is not decode])
                return Placement(prefill, decode, "unplanned", f"{prompt_tokens} prompt tokens >= "
                                 f"{_UNPLANNED_SPLIT_TOKENS}: split (no step costs known)")  # fmt: skip
            return Placement(None, self._least_requests(members), "unplanned",
                             f"{prompt_tokens} prompt tokens < {_UNPLANNED_SPLIT_TOKENS}: whole")  # fmt: skip
        if not prefill_side or not decode_side:
            why = f"{layout}: whole" if self._layout is not None else "one instance in service: whole"
            if self._layout is not None and self._is_cheap(prompt_tokens):
                why = f"{layout}: {prompt_tokens} prompt tokens cost less than a decode step: whole"
            whole = self._least_prompt_backlog(self._with_room(members))
            return Placement(None, whole, layout, why, self._predicted(False))
        if self._is_cheap(prompt_tokens):
            return Placement(None, self._most_room(decode_side), layout, f"{layout}: {prompt_tokens} "
                             "prompt tokens cost less than a decode step: whole on a decode")  # fmt: skip
        if prompt_tokens <= self._whole_below:
            # Short enough for the decode side's spare time: its TTFT is that instance's own prompts
            # ahead of it, not the prefill side's queue of long ones.
            whole = self._least_prompt_backlog(self._with_room(decode_side))
            return Placement(None, whole, layout, f"{layout}: {prompt_tokens} prompt tokens <= "
                             f"{self._whole_below}, within the decode side's spare time: whole on a decode")  # fmt: skip
        decode = self._most_room(decode_side)
        prefill = self._least_prefill(prefill_side)
        return Placement(prefill, decode, layout, self._why_split(layout), self._predicted(True))

    def _predicted(self, is_split: bool) -> tuple[float, float] | None:
        """The layout's (TTFT, TPOT) before calibration, for a placement of its own kind (what a
        measurement is compared to); None for another kind, or no layout."""
        if self._layout is None or self._layout.is_split != is_split:
            return None
        ttft_factor, tpot_factor = self._calibration.factors(is_split)
        return self._layout.ttft_s / ttft_factor, self._layout.tpot_s / tpot_factor

    def _own(self, placement: Placement[C], prompt_tokens: int, output_len: int) -> tuple[float, float]:
        """The model's (TTFT, TPOT) for this request, before calibration: its own prompt behind the prompts
        queued where it goes, and a step of the streams there with it (served whole: that step alone,
        the prompts that stretch its steps are counted as it ends, ``_stretch``). Judged against the
        layout's averages instead, a 5,000-token prompt among 300-token ones measures ten times "the
        model", and the factors would say the step costs are off when only the lengths are mixed."""
        costs, layout = self._settings.costs, placement.predicted
        assert costs is not None and layout is not None
        now, decode = self._clock(), placement.decode.url
        steps = -(-prompt_tokens // costs.max_num_batched_tokens)
        per_seq = step_share(costs, prompt_tokens, output_len, whole=False)
        step = costs.step_base_s + per_seq * (self._batches.count(decode) + 1)
        compute = steps * costs.step_base_s + costs.prefill_per_token_s * prompt_tokens
        if placement.prefill is None:
            ahead = max(0.0, self._prompts_until.get(decode, now) - now)
            ttft = costs.lone_request_overhead_s + ahead + compute + step
            return ttft, step
        else:
            ahead = max(0.0, self._prefills_until.get(placement.prefill.url, now) - now)
            blocks = -(-prompt_tokens // costs.block_size)
            ttft = 2 * costs.lone_request_overhead_s + ahead + compute + costs.pull_seconds(blocks) + 2 * step
        # The layout's TPOT counts the traffic to come (the batch it grows to); the step now counts a
        # batch the plan's rate estimate has not caught up with.
        return ttft, max(layout[1], step)

    def _why_split(self, layout: str) -> str:
        assert self._layout is not None
        load = self._load()
        rate = f"{load.rate:.1f} req/s of {load.input_len} in / {load.output_len} out" if load else "no load"
        ttft_factor, tpot_factor = self._calibration.factors(True)
        calibrated = (
            f" (measured x{ttft_factor:.2g} and x{tpot_factor:.2g} the model here)"
            if (ttft_factor, tpot_factor) != (1.0, 1.0)
            else ""
        )
        return (
            f"{layout} for {rate}: predicted TTFT {_ms(self._layout.ttft_s)} ms, "
            f"TPOT {_ms(self._layout.tpot_s)} ms{calibrated}"
        )

    def _is_cheap(self, prompt_tokens: int) -> bool:
        """Whether the prompt costs less to compute than a decode step (a split would cost more)."""
        costs = self._settings.costs
        return costs is not None and prompt_tokens <= judging.cheap_below(costs)

    def _with_room(self, members: Sequence[C]) -> Sequence[C]:
        """Those of ``members`` below the most requests the TPOT objective allows (all, if none is)."""
        below = [m for m in members if self._batches.count(m.url) < self._cap_at(m.url)]
        return below or members

    def _most_room(self, members: Sequence[C]) -> C:
        """The decode-side instance furthest below its cap (``_cap_at``), then with the fewest requests:
        the caps differ by what each runs, so the fewest requests may be the one with no room left."""
        return min(members, key=lambda m: (self._batches.count(m.url) - self._cap_at(m.url),
                                           self._batches.count(m.url), load_score(m)))  # fmt: skip

    def _least_requests(self, members: Sequence[C]) -> C:
        return min(members, key=lambda m: (self._batches.count(m.url), load_score(m)))

    def _least_prompt_backlog(self, members: Sequence[C]) -> C:
        """Where a whole request's prompt is computed soonest. Its TTFT is the prompts queued ahead of it
        there; decodes cost it a few ms a step. The fewest requests would send it, every time a
        decode finishes, to an instance still computing a long prompt (colocated at 90 req/s of 2,000
        tokens: TTFT p90 264 ms against round robin's 82)."""
        if self._settings.costs is None:
            return self._least_requests(members)
        now = self._clock()
        return min(members, key=lambda m: (max(now, self._prompts_until.get(m.url, now)),
                                           self._batches.count(m.url), load_score(m)))  # fmt: skip

    def _least_prefill(self, members: Sequence[C]) -> C:
        return min(members, key=lambda m: (self._prefill_tokens.get(m.url, 0), load_score(m)))

    def _begin(self, placement: Placement[C], prompt_tokens: int) -> None:
        decode = placement.decode.url
        self._batches.begin(decode, placement.step_share_s)
        if placement.prefill is not None:
            url = placement.prefill.url
            self._prefill_tokens[url] = self._prefill_tokens.get(url, 0) + prompt_tokens
            self.decisions["split"] += 1
            self._queue(self._prefills_until, url, prompt_tokens)
        else:
            self.decisions["whole"] += 1
            self._queue(self._prompts_until, decode, prompt_tokens)

    def _queue(self, until: dict[str, float], url: str, prompt_tokens: int) -> None:
        """A prompt queued at ``url``: when its prompts should all be computed, by the step costs."""
        costs = self._settings.costs
        if costs is not None:
            steps = -(-prompt_tokens // costs.max_num_batched_tokens)
            now = self._clock()
            start = max(now, until.get(url, now))
            until[url] = start + steps * costs.step_base_s + costs.prefill_per_token_s * prompt_tokens
            log = self._prompt_log.setdefault(url, deque(maxlen=_PROMPT_LOG))
            log.append((now, until[url], prompt_tokens))


def _describe_load(load: Load) -> dict[str, object]:
    return {"rate": round(load.rate, 2), "input_len": load.input_len, "output_len": load.output_len}


def _clearly_better(new: Layout, current: Layout) -> bool:
    """Whether ``new`` (ranked first) should displace ``current``: by a margin, so noise in the load
    estimate does not flip the pool back and forth."""
    if new.num_prefill == current.num_prefill:
        return False
    if new.capacity is not None and current.capacity is not None:
        if new.meets_slo != current.meets_slo:
            return new.meets_slo
        return new.capacity > current.capacity * _HYSTERESIS
    if current.slack > 0:
        return new.slack > current.slack * _HYSTERESIS
    return new.slack > current.slack / _HYSTERESIS  # both negative (no SLO: minus the latency)


def _ms(seconds: float) -> float | None:
    return None if seconds != seconds or seconds == float("inf") else round(seconds * 1000, 1)

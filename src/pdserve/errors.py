"""Every exception pdserve defines, in one tree.

    PDServeError
    ├── ConfigError            a config, flag or topology file is invalid (raised at construction)
    ├── EngineError            launching or supervising a vLLM instance failed
    │   └── EngineStartError   an instance died or never became healthy while starting
    ├── ProxyStartError        a worker of a multi-process proxy died or did not answer while starting
    ├── ModelBuildError        the embedded tiny model could not be built
    ├── VerifyError            `pdserve verify` could not run its checks (not: a check failed)
    ├── Stalled                a tool's request saw nothing move for too long, or ran past its limit
    ├── CalibrationError       `pdserve sim calibrate` could not measure or fit the instance
    ├── BenchError             `pdserve bench` could not run vLLM's benchmark client or read its results
    ├── Unreachable            a blocking HTTP call (httpclient.py) reached no server
    │   └── NoAnswer           it connected, but no answer came within the timeout (a busy server)
    ├── MetricsUnreadable      a ``/metrics`` could not be read (prometheus.scrape): each caller decides
    ├── DiscoveryError         the Kubernetes API could not be read (unreachable, forbidden, no config)
    ├── ClientGone             the client hung up while its request was being read
    ├── RequestRefused         the proxy answers the client itself, before any instance is called
    │   ├── BadRequest         400: not JSON, not an object
    │   ├── BodyTooLarge       413: over the body limit
    │   └── Overloaded         429 (queue full) or 503 (queue timeout), with Retry-After
    ├── UpstreamError          a call from the proxy to an instance (or a sibling worker) failed; carries phase and URL
    │   ├── UpstreamUnavailable    the connection broke, or the instance answered 5xx
    │   │   ├── UpstreamConnectError   could not connect: the instance never saw the request
    │   │   ├── UpstreamStaleConnection a kept-alive connection closed before any answer byte
    │   │   ├── UpstreamSuspectAnswer  what was already streamed may rest on KV released too early
    │   │   └── UpstreamDiverged       decode's stream cannot follow prefill's first token, which the client has
    │   ├── UpstreamTimeout        a per-phase limit or the request's deadline ran out
    │   ├── UpstreamProtocolError  the instance answered, but not as the NixlConnector protocol says
    │   ├── NoInstanceAvailable    every instance of a role is unhealthy, draining or circuit-open
    │   └── DecodeBacklogged       503: decode could not take the KV within its lease for the wait's limit
    └── SimError               the simulator's own (sim/), as vLLM would show them
        ├── SimRequestError    a request vLLM would refuse: status, type, param and message
        ├── ChatTemplateError  the messages cannot be rendered (vLLM answers 400)
        ├── KVPullError        a decode could not pull its KV (lease expired, holder gone, fault)
        ├── EngineStoppedError the engine stopped while a request was in it
        └── ConnectionDropped  raised out of an app to make the server close the connection

Errors of the libraries underneath are translated into these at each client's boundary, and nowhere
else: connection, OS and timeout errors of the proxy's own HTTP client (``proxy/wire/client.py``, toward
the instances and the sibling workers) in ``proxy/wire/failures.py``; aiohttp in ``sim/transfer.py`` (the
simulator's KV pulls) and ``sim/probe.py`` (calibration), while ``bench/load.py`` counts them as failed
requests; urllib and http.client in ``httpclient.py``; subprocess in ``engines/launcher.py`` (the
instances), ``engines/model.py`` (the tiny model's build) and ``bench/vllmbench.py``, while
``engines/venv.py``'s version probe makes a failure "version unknown", a warning; yaml in
``topologyfile.py``, ``sim/profile.py`` and ``sim/calibrate.py`` (``--set``); lightkube in
``proxy/pool/k8s_watch.py``; ray in ``engines/ray_cluster.py``.
``UpstreamError.status`` is the HTTP status the proxy answers the client with.
"""

from __future__ import annotations


class PDServeError(Exception):
    """Base of every pdserve error."""


class ConfigError(PDServeError, ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class EngineError(PDServeError):
    """Launching or supervising a vLLM instance failed."""


class EngineStartError(EngineError):
    """An instance exited or did not become healthy in time; the message holds its log tail."""


class ProxyStartError(PDServeError):
    """A proxy worker (proxy/serving/workers.py) exited or did not answer while starting."""


class ModelBuildError(PDServeError):
    """The embedded tiny model could not be built."""


class VerifyError(PDServeError):
    """`pdserve verify` could not run (proxy unreachable, no instances listed)."""


class Stalled(PDServeError):
    """A request of verify, doctor's canary or the demo got no answer while no instance made progress
    for the stated time (or past the overall limit); the message names the request and the instances."""


class CalibrationError(PDServeError):
    """Calibration could not run: the server is unreachable, answered unexpectedly, or the data cannot be fitted."""


class BenchError(PDServeError):
    """vLLM's benchmark client failed or timed out, or its result file is not what pdserve reads."""


class Unreachable(PDServeError):
    """No HTTP server answered at the URL (refused, timed out, name not found)."""


class NoAnswer(Unreachable):
    """The server took the connection and the request, but its answer did not come within the timeout:
    a queue or a stuck server, never a "cannot reach"."""


class MetricsUnreadable(PDServeError):
    """An instance's or the proxy's ``/metrics`` did not answer 200 (or did not answer at all).

    One scraper raises it (``prometheus.scrape``); what it means is the caller's: verify fails, doctor
    reports it as a failed check, bench counts the instance as adding nothing, top shows the reason."""


class DiscoveryError(PDServeError):
    """Kubernetes discovery could not list or watch pods; the proxy keeps what it knew and retries."""


class ClientGone(PDServeError):
    """The client disconnected before its request body was complete."""


class RequestRefused(PDServeError):
    """The proxy refuses the request itself; ``status`` is what the client is answered."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(RequestRefused):
    """The client's body is not something any vLLM would take; answered without calling upstream."""


class BodyTooLarge(RequestRefused):
    status = 413

    def __init__(self, message: str = "request body too large") -> None:
        super().__init__(message)


class Overloaded(RequestRefused):
    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class WholeOnRefused(RequestRefused):
    """A request for one named instance's whole answer (``X-Pdserve-Whole-On``) the proxy will not serve:
    the admin key is missing or wrong (401), or no instance has that name (404)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamError(PDServeError):
    """A call from the proxy to a prefill or decode instance failed.

    ``phase`` is "prefill" or "decode" (or "models"/"health" for auxiliary calls), ``url`` the instance.
    The same client asks a multi-process proxy's sibling workers (phase "worker", ``url`` their Unix
    socket); peers.py reports those misses itself, and no client is ever answered with one.
    """

    status = 502
    error_type = "upstream_error"
    # A slow instance is not a dead one: timeouts do not open its circuit; health checks decide.
    is_slow = False

    def __init__(self, phase: str, url: str, detail: str, *, is_slow: bool | None = None) -> None:
        self.phase = phase
        self.url = url
        self.detail = detail
        if is_slow is not None:
            self.is_slow = is_slow
        super().__init__(f"{phase} instance {url}: {detail}")


class UpstreamUnavailable(UpstreamError):
    status = 502
    error_type = "upstream_unavailable"


class UpstreamConnectError(UpstreamUnavailable):
    """The request never reached the instance, so whatever it carried (e.g. KV params) is still unused."""


class UpstreamStaleConnection(UpstreamUnavailable):
    """A reused keep-alive connection closed before a byte of the answer came: most likely the instance
    had closed it while idle and never read the request, but an instance that died on it reads the same."""


class UpstreamSuspectAnswer(UpstreamUnavailable):
    """Prefill's log discredited a stream already under way: its text may rest on released KV, so it
    ends with an error and is not continued elsewhere (proxy/request/migrate.py)."""


class UpstreamDiverged(UpstreamUnavailable):
    """Decode's stream cannot follow prefill's first token, which the client already has: decode sampled
    another (bf16 logits of two instances differ), or the lease guard withheld its answer before any of
    it went out. Nothing is wrong with decode, and the stream goes on from prefill's token on any
    instance, this one included (proxy/request/migrate.py)."""


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "upstream_timeout"
    is_slow = True


class UpstreamProtocolError(UpstreamError):
    status = 502
    error_type = "upstream_protocol_error"


class NoInstanceAvailable(UpstreamError):
    status = 503
    error_type = "no_instance_available"
    retry_after_s = 2  # instances come back (restarts, drains ending) within seconds

    def __init__(self, phase: str, detail: str) -> None:
        super().__init__(phase, "-", detail)
        self.args = (f"no {phase} instance available: {detail}",)

    def __str__(self) -> str:
        return str(self.args[0])


class DecodeBacklogged(UpstreamError):
    """The request waited at the proxy for its decode to have room to pull its KV within prefill's lease
    (proxy/pool/backpressure.py) and the wait reached its limit: nothing was prefilled."""

    status = 503
    error_type = "decode_backlogged"

    def __init__(self, url: str, waited_s: float, limit_s: float, why: str) -> None:
        super().__init__("decode", url, f"waited {waited_s:.1f} s for room to pull the KV within prefill's lease, "
                         f"the limit (--max-decode-wait {limit_s:g} s); {why}")  # fmt: skip
        self.retry_after_s = max(1, round(limit_s / 4))


class SimError(PDServeError):
    """Base of the simulator's errors."""


class SimRequestError(SimError):
    """A request vLLM would refuse: the status, message, type and param of its error body."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


class ChatTemplateError(SimError, ValueError):
    """The messages cannot be rendered (vLLM answers these with a 400)."""


class KVPullError(SimError):
    """A decode could not pull its KV: the lease expired, the holder is gone, or a fault was injected."""


class EngineStoppedError(SimError, RuntimeError):
    """The engine was stopped (or its step loop failed) while a request was in it, or before it started."""


class ConnectionDropped(SimError):
    """Raised out of the app to make the server close the connection (fallback of ``Writer.drop``)."""

"""Every error pdserve raises on purpose.

The tree::

    PDServeError
    ├── ConfigError            a config, flag or topology file is invalid (raised at construction)
    ├── EngineError            launching or supervising a vLLM instance failed
    │   └── EngineStartError   an instance died or never became healthy while starting
    ├── ModelBuildError        the embedded tiny model could not be built
    ├── VerifyError            `pdserve verify` could not run its checks (not: a check failed)
    ├── CalibrationError       `pdserve sim calibrate` could not measure or fit the instance
    └── UpstreamError          a call from the proxy to an instance failed; carries phase and URL
        ├── UpstreamUnavailable    the connection broke, or the instance answered 5xx
        │   └── UpstreamConnectError   could not connect: the instance never saw the request
        ├── UpstreamTimeout        a per-phase time limit ran out
        ├── UpstreamProtocolError  the instance answered, but not as the NixlConnector protocol says
        └── NoInstanceAvailable    every instance of a role is unhealthy, draining or circuit-open

Errors of the libraries underneath (aiohttp, subprocess, yaml) are translated into these in exactly one
place each: ``proxy/upstream.py`` for HTTP, ``engines/launcher.py`` for processes, ``config.py`` for YAML.
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


class ModelBuildError(PDServeError):
    """The embedded tiny model could not be built."""


class VerifyError(PDServeError):
    """`pdserve verify` could not run (proxy unreachable, no instances listed)."""


class CalibrationError(PDServeError):
    """Calibration could not run: the server is unreachable, answered unexpectedly, or the data cannot be fitted."""


class UpstreamError(PDServeError):
    """A call from the proxy to a prefill or decode instance failed.

    ``phase`` is "prefill" or "decode" (or "models"/"health" for auxiliary calls), ``url`` the instance.
    """

    status = 502
    error_type = "upstream_error"

    def __init__(self, phase: str, url: str, detail: str) -> None:
        self.phase = phase
        self.url = url
        self.detail = detail
        super().__init__(f"{phase} instance {url}: {detail}")


class UpstreamUnavailable(UpstreamError):
    status = 502
    error_type = "upstream_unavailable"


class UpstreamConnectError(UpstreamUnavailable):
    """The request never reached the instance, so whatever it carried (e.g. KV params) is still unused."""


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "upstream_timeout"


class UpstreamProtocolError(UpstreamError):
    status = 502
    error_type = "upstream_protocol_error"


class NoInstanceAvailable(UpstreamError):
    status = 503
    error_type = "no_instance_available"

    def __init__(self, phase: str, detail: str) -> None:
        super().__init__(phase, "-", detail)
        self.args = (f"no {phase} instance available: {detail}",)

    def __str__(self) -> str:
        return str(self.args[0])

"""Kubernetes label syntax: the selectors the proxy's discovery takes, and annotation keys.

A leaf: config.py validates with it, proxy/pool/discovery.py parses with it.
"""

from __future__ import annotations

import re

from pdserve.errors import ConfigError

# Kubernetes label syntax: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def is_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.fullmatch(name)) and (not prefix or bool(_LABEL_PREFIX.fullmatch(prefix)))


def label_selector(text: str) -> dict[str, str]:
    """``"app=vllm,role=prefill"`` → ``{"app": "vllm", "role": "prefill"}``; ConfigError if malformed.

    Equality only (``=`` or ``==``), as vllm-router and the SGLang gateway take them: the proxy sends the
    selector to the API server and checks it again on every pod, and equality is all both sides agree on.
    An empty selector would match every pod in the namespace, so at least one label is required.
    """
    pairs: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.replace("==", "=").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or "!" in key or not is_label_key(key) or (value and not _LABEL_NAME.fullmatch(value)):
            raise ConfigError(
                f"label selector {text!r}: {part!r} is not key=value with Kubernetes label syntax"
            )
        if key in pairs:
            raise ConfigError(f"label selector {text!r} names {key!r} twice")
        pairs[key] = value
    return pairs

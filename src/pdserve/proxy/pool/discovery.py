"""Kubernetes discovery: pods found by a pool's label selector join and leave that pool.

    a pod Ready, with an IP and a port    → added at http://<pod IP>:<port> (its model checked first,
                                            as the admin API checks it)
    not Ready (or its port unknown)       → taken out: no new requests, removed once the in-flight end
    being deleted (deletionTimestamp)     → drained: its in-flight requests finish, no new ones come
    gone                                  → removed
    the same pod at a new IP (recreated)  → the old URL removed, the new one added

The port is the pod's ``k8s_port_annotation`` if it has one, else ``k8s_port`` (a number, or the name of
one of its container ports), as the SGLang gateway reads a pod's bootstrap port from an annotation.

Level-triggered, like a Kubernetes controller: the watches (k8s_watch.py) only update what is known of
the pods, and one pass at a time moves the pools toward it, after every change and every second. So an
add that had to wait (an engine not yet answering /v1/models, the old instance at that URL still
draining) is tried again, and a watch that broke ends in a fresh list, not in lost events. Discovery only
ever takes out what it added: static --prefill/--decode/--instance URLs and admin-API instances are left
alone, and an instance the admin API drained or removed is not put back while its pod stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from pdserve.config import ProxyConfig, Role
from pdserve.errors import DiscoveryError
from pdserve.labels import label_selector
from pdserve.proxy.pool.instance import Instance, Lifecycle
from pdserve.proxy.pool.k8s_watch import PodChanged, PodEvent, PodView, PodWatcher
from pdserve.proxy.pool.models import model_ids, models_in_service
from pdserve.proxy.pool.state import ProxyState

log = logging.getLogger("pdserve.proxy")

_RESYNC_S = 1.0  # a pass at least this often: retries adds that had to wait
_BACKOFF_S = (1.0, 30.0)  # after a broken watch: first wait, longest wait

PodKey = tuple[Role, str]  # (role, namespace/name)


class PodSource(Protocol):
    """Where pods come from (``PodWatcher``; a test may pass its own)."""

    def watch(self, selector: Mapping[str, str]) -> AsyncIterator[PodEvent]: ...
    async def close(self) -> None: ...


def pod_url(pod: PodView, port: str, annotation: str) -> tuple[str | None, str | None]:
    """The pod's instance URL, or None and why there is none yet."""
    if pod.ip is None:
        return None, "no pod IP yet"
    value = pod.annotations.get(annotation, port)
    number = int(value) if value.isdigit() else pod.ports.get(value)
    if number is None or not 0 < number <= 65535:
        where = f"annotation {annotation}" if annotation in pod.annotations else "its container ports"
        return None, f"no port {value!r} in {where}"
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"http://{host}:{number}", None


class Discovery:
    def __init__(self, state: ProxyState, config: ProxyConfig, source: PodSource | None = None) -> None:
        self._state = state
        self._config = config
        self._source = source or PodWatcher(config.discovery.api_server, config.discovery.namespace)
        self._selectors = {p.role: label_selector(p.selector) for p in config.pools if p.selector is not None}
        self._pods: dict[Role, dict[str, PodView]] = {role: {} for role in self._selectors}
        self._owned: dict[PodKey, Instance] = {}  # the instances discovery added, by pod
        self._refused: dict[PodKey, str] = {}  # pod → the URL refused for its model (until it changes)
        self._leaving: dict[str, Instance] = {}  # URL → our instance there that is being removed
        self._noted: set[tuple[str, str]] = set()  # (pod, problem) already logged
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Watch and reconcile until cancelled."""
        follows = [asyncio.create_task(self._follow(role, sel)) for role, sel in self._selectors.items()]
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), _RESYNC_S)
                self._changed.clear()
                await self._reconcile()
        finally:
            for task in follows:
                task.cancel()
            await asyncio.gather(*follows, return_exceptions=True)
            await self._source.close()

    # --- what is known of the pods ------------------------------------------------------------------

    async def _follow(self, role: Role, selector: Mapping[str, str]) -> None:
        wait = _BACKOFF_S[0]
        while True:
            try:
                async for event in self._source.watch(selector):
                    self._apply(role, selector, event)
                    wait = _BACKOFF_S[0]
            except DiscoveryError as exc:
                # What was known stays: an API server outage must not empty the pools.
                log.warning("watching %s pods (%s): %s; again in %g s", role, _text(selector), exc, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, _BACKOFF_S[1])

    def _apply(self, role: Role, selector: Mapping[str, str], event: PodEvent) -> None:
        pods = self._pods[role]
        if isinstance(event, PodChanged):
            changed = [event.pod]
            if event.is_gone:
                pods.pop(event.pod.key, None)
                changed = []
        else:
            pods.clear()
            changed = list(event.pods)
        for pod in changed:
            # Filtered again here: a server may ignore the selector, and a relabelled pod must leave.
            if all(pod.labels.get(k) == v for k, v in selector.items()):
                pods[pod.key] = pod
            else:
                pods.pop(pod.key, None)
        self._changed.set()

    # --- moving the pools toward it -----------------------------------------------------------------

    async def _reconcile(self) -> None:
        matches = Counter(key for pods in self._pods.values() for key in pods)
        in_several = {key for key, num in matches.items() if num > 1}
        adds: list[tuple[PodKey, str]] = []
        for role, pods in self._pods.items():
            for key, pod in pods.items():
                if key in in_several:
                    roles = " and the ".join(r for r, found in self._pods.items() if key in found)
                    self._note(key, f"matches both the {roles} selector: not used")
                elif (url := self._settle((role, key), pod)) is not None:
                    adds.append(((role, key), url))
        for pod_key in [k for k in self._owned if k[1] not in self._pods[k[0]] or k[1] in in_several]:
            self._take_out(pod_key, "pod gone")
        for url, instance in list(self._leaving.items()):
            if self._state.find(url) is not instance:
                del self._leaving[url]  # its removal is complete
        # Forget what was said about pods that are gone: a pod of that name later is a new pod.
        known = matches.keys()
        self._noted = {noted for noted in self._noted if noted[0] in known}
        self._refused = {k: url for k, url in self._refused.items() if k[1] in self._pods[k[0]]}
        await asyncio.gather(*(self._add(pod_key, url) for pod_key, url in adds))

    def _settle(self, pod_key: PodKey, pod: PodView) -> str | None:
        """Drain or take out what must go; the URL to add, if the pod should serve and does not yet."""
        owned = self._owned.get(pod_key)
        if pod.is_terminating:
            if owned is not None and not owned.is_draining:
                self._state.drain(owned)
            return None
        url, problem = pod_url(pod, self._config.discovery.port, self._config.discovery.port_annotation)
        if not pod.is_ready or url is None:
            if owned is not None:
                self._take_out(pod_key, problem or "pod not ready")
            if problem and pod.is_ready:
                self._note(pod.key, problem)
            return None
        if owned is not None:
            if owned.url == url:
                return None
            self._take_out(pod_key, f"pod now at {url}")
        if self._refused.get(pod_key) == url:
            return None
        present = self._state.find(url)
        if present is not None and present is not self._leaving.get(url):
            self._note(pod.key, f"{url} is already in a pool (given on the command line or by the admin API)")
        return None if present is not None else url  # a URL still draining is added on a later pass

    def _take_out(self, pod_key: PodKey, why: str) -> None:
        instance = self._owned.pop(pod_key)
        self._refused.pop(pod_key, None)
        if instance.lifecycle is not Lifecycle.REMOVED:
            log.info("discovery: %s pod %s at %s: %s", pod_key[0], pod_key[1], instance.url, why)
            self._state.remove(instance)
            self._leaving[instance.url] = instance

    async def _add(self, pod_key: PodKey, url: str) -> None:
        role, key = pod_key
        instance = self._state.new_instance(role, url)
        await instance.upstream.open()
        timeout = self._config.models_timeout_s
        served = await model_ids(instance, timeout)
        expected = await models_in_service((pool.instances for pool in self._state.pools), timeout)
        pod = self._pods[role].get(key)
        wanted = (
            pod is not None
            and pod.is_ready
            and not pod.is_terminating
            and pod_url(pod, self._config.discovery.port, self._config.discovery.port_annotation)[0] == url
        )
        if not served or (expected and not served & expected) or not wanted or self._state.find(url):
            await instance.upstream.close()
            if served and expected and not served & expected:
                self._refused[pod_key] = url
                log.warning("discovery: refusing %s pod %s at %s: it serves %s, the pools %s",
                            role, key, url, sorted(served), sorted(expected))  # fmt: skip
            return  # not answering /v1/models yet, or changed meanwhile: the next pass decides
        self._state.add(instance)
        self._owned[pod_key] = instance
        log.info("discovery: %s pod %s added at %s", role, key, url)

    def _note(self, pod: str, problem: str) -> None:
        if (pod, problem) not in self._noted:
            self._noted.add((pod, problem))
            log.warning("discovery: pod %s: %s", pod, problem)


def _text(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())

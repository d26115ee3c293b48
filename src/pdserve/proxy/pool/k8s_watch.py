"""The proxy's one boundary to the Kubernetes API: list, then watch, the pods of one label selector.

lightkube (async) does the talking; what comes out are plain ``PodView`` values, and every lightkube or
httpx error becomes a ``DiscoveryError`` here. The selector goes to the API server, which narrows the
stream; discovery.py checks it again on every pod, because not every server honours it (the mock one
in the tests does not) and a pod whose labels stop matching must leave.

A stream starts with ``PodsListed`` (every matching pod now: whatever is missing from it is gone),
then ``PodChanged`` for each event after that list. When it raises, the caller starts a new one, so a
watch that broke for a while ends in a fresh list rather than in events that were never seen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from pdserve.errors import ConfigError, DiscoveryError

try:
    import httpx2
    from lightkube import ApiError, AsyncClient, KubeConfig, NotReadyError
    from lightkube import ConfigError as KubeConfigError
    from lightkube.config.models import Cluster, User
    from lightkube.core.client import LabelSelector
    from lightkube.resources.core_v1 import Pod
except ImportError as exc:  # an optional extra: only a proxy with discovery needs it
    raise ConfigError("Kubernetes discovery needs lightkube: pip install 'pdserve[k8s]'") from exc


@dataclass(frozen=True)
class PodView:
    """What discovery needs to know of one pod."""

    key: str  # namespace/name: stays when a StatefulSet or LeaderWorkerSet recreates the pod elsewhere
    ip: str | None  # status.podIP; None until the pod is scheduled and has a sandbox
    is_ready: bool  # the Ready condition is True (its readiness probe passes)
    is_terminating: bool  # metadata.deletionTimestamp is set: it is shutting down
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # named container ports → numbers


@dataclass(frozen=True)
class PodsListed:
    pods: tuple[PodView, ...]


@dataclass(frozen=True)
class PodChanged:
    pod: PodView
    is_gone: bool  # DELETED: the object no longer exists


PodEvent = PodsListed | PodChanged


def _view(pod: Pod) -> PodView:
    meta, status, spec = pod.metadata, pod.status, pod.spec
    name = meta.name if meta and meta.name else "?"
    namespace = meta.namespace if meta and meta.namespace else "?"
    conditions = status.conditions if status and status.conditions else []
    ports = {
        port.name: port.containerPort
        for container in (spec.containers if spec else [])
        for port in container.ports or []
        if port.name
    }
    return PodView(
        key=f"{namespace}/{name}",
        ip=status.podIP if status and status.podIP else None,
        is_ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
        is_terminating=bool(meta and meta.deletionTimestamp),
        labels=dict(meta.labels or {}) if meta else {},
        annotations=dict(meta.annotations or {}) if meta else {},
        ports=ports,
    )


class PodWatcher:
    """Pods of one namespace, through one API client shared by every selector."""

    def __init__(self, api_server: str | None, namespace: str | None) -> None:
        try:
            if api_server is None:
                config = KubeConfig.from_env()  # in-cluster service account, $KUBECONFIG, ~/.kube/config
            else:  # e.g. `kubectl proxy`'s http://127.0.0.1:8001 (from_server alone lacks a user)
                config = KubeConfig.from_one(
                    cluster=Cluster(server=api_server), user=User(), namespace=namespace
                )
            # trust_env=False: the proxy never routes through $http_proxy (docs/architecture.md)
            self._client = AsyncClient(config, namespace=namespace, trust_env=False)
        except KubeConfigError as exc:
            raise DiscoveryError(f"no Kubernetes API to watch: {exc}") from exc

    @property
    def namespace(self) -> str:
        return str(self._client.namespace)

    async def watch(self, selector: Mapping[str, str]) -> AsyncIterator[PodEvent]:
        """The pods matching ``selector`` now, then their changes; raises DiscoveryError when it breaks."""
        labels: LabelSelector = dict(selector)
        namespace = self._client.namespace
        try:
            listing = self._client.list(Pod, namespace=namespace, labels=labels)
            yield PodsListed(tuple([_view(pod) async for pod in listing]))
            try:
                version: str | None = listing.resourceVersion
            except NotReadyError:  # an empty answer may carry none: watch from "now" instead
                version = None
            async for kind, pod in self._client.watch(
                Pod, namespace=namespace, labels=labels, resource_version=version
            ):
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    yield PodChanged(_view(pod), is_gone=kind == "DELETED")
        except ApiError as exc:
            raise DiscoveryError(f"API server answered {exc.status.code}: {exc.status.message}") from exc
        except httpx2.HTTPError as exc:
            raise DiscoveryError(f"API server unreachable: {exc!r}") from exc

    async def close(self) -> None:
        await self._client.close()

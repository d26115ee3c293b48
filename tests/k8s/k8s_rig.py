"""Pods a test moves through their lives on a mock Kubernetes API server (kmock's emulator), and a real
proxy that discovers them through lightkube.

kmock keeps objects and streams watch events, but it is no kubelet: a test sets a pod's IP, its Ready
condition and its deletion itself. Its pods carry a finalizer, so deleting one leaves it terminating
(deletionTimestamp set, as during a real pod's grace period) until ``Cluster.finish_deleting``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from asgi_rig import listening_socket, serve_in_thread
from pdserve.config import ROLES, ProxyConfig, Timeouts
from pdserve.configparts import HealthChecks, K8sDiscovery, PoolSpec
from pdserve.proxy.serving.server import make_server

NAMESPACE = "serving"
APP = {"app.kubernetes.io/name": "pdserve"}
SELECTORS = {
    "prefill": "app.kubernetes.io/name=pdserve,llm-d.ai/role=prefill",
    "decode": "app.kubernetes.io/name=pdserve,llm-d.ai/role=decode",
}
_FINALIZER = "tests.pdserve/grace-period"
_PORTS = range(65000, 65400)  # what these tests may bind


def free_ports(n: int, *hosts: str) -> list[int]:
    """``n`` ports in 65000-65399 free on every one of ``hosts`` (default 127.0.0.1; a pod may move)."""
    found: list[int] = []
    for port in _PORTS:
        socks = []
        try:
            for host in hosts or ("127.0.0.1",):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
            found.append(port)
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        if len(found) == n:
            return found
    raise RuntimeError("not enough free ports in 65000-65399")


class Cluster:
    """The test's side of the API server: what the kubelet and the controllers would do to pods."""

    def __init__(self, api: AsyncClient) -> None:
        self.api = api

    async def create_pod(
        self,
        name: str,
        role: str,
        ip: str,
        port: int,
        *,
        ready: bool = False,
        labels: dict[str, str] | None = None,
    ) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": labels if labels is not None else {**APP, "llm-d.ai/role": role},
                "annotations": {"pdserve/port": str(port)},  # every "pod" shares 127.0.0.x: ports differ
                "finalizers": [_FINALIZER],
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": _status(ip, ready),
        }
        await self.api.create(Pod.from_dict(body))

    async def set_ready(self, name: str, ready: bool) -> None:
        pod = await self.api.get(Pod, name, namespace=NAMESPACE)
        assert pod.status is not None
        await self._patch(name, {"status": _status(pod.status.podIP, ready)})

    async def move(self, name: str, ip: str) -> None:
        """The pod recreated under its name (a StatefulSet's, a LeaderWorkerSet's) on another node."""
        await self._patch(name, {"status": _status(ip, True)})

    async def delete(self, name: str) -> None:
        """`kubectl delete pod`: it is terminating now, gone after ``finish_deleting``."""
        await self.api.delete(Pod, name, namespace=NAMESPACE)

    async def finish_deleting(self, name: str) -> None:
        await self._patch(name, {"metadata": {"finalizers": []}})

    async def _patch(self, name: str, patch: dict[str, Any]) -> None:
        await self.api.patch(Pod, name, patch, namespace=NAMESPACE, patch_type=PatchType.MERGE)


def _status(ip: str | None, ready: bool) -> dict[str, Any]:
    return {
        "phase": "Running",
        "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }


@contextmanager
def discovering_proxy(api_server: str, **config: Any) -> Iterator[str]:
    """A real proxy (uvloop, httptools) in its own thread, with no static instances: only discovery."""
    sock = listening_socket()
    proxy_config = ProxyConfig(
        pools=tuple(PoolSpec(role, selector=SELECTORS[role]) for role in ROLES),
        port=sock.getsockname()[1],
        timeouts=Timeouts(connect=1, prefill=5, first_token=5, idle=5, decode=10),
        health=HealthChecks(interval_s=0.5),
        discovery=K8sDiscovery(namespace=NAMESPACE, api_server=api_server),
        **config,
    )
    with serve_in_thread(make_server(proxy_config, log_level="warning"), sock, stop_s=15) as url:
        yield url

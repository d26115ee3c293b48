"""Fixtures for the Kubernetes tests: the mock API server's URL and the test's client to it (k8s_rig.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import kmock
import pytest
from k8s_rig import NAMESPACE, Cluster
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster as ClusterConfig
from lightkube.config.models import User


@pytest.fixture
async def cluster(kmock: kmock.KubernetesEmulator) -> AsyncIterator[Cluster]:
    kmock.resources["v1/pods"] = {}
    config = KubeConfig.from_one(
        cluster=ClusterConfig(server=str(kmock.url)), user=User(), namespace=NAMESPACE
    )
    api = AsyncClient(config, trust_env=False)
    try:
        yield Cluster(api)
    finally:
        await api.close()


@pytest.fixture
def api_server(kmock: kmock.KubernetesEmulator) -> str:
    return str(kmock.url)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session

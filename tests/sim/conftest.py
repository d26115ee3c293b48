"""Fixtures for the sim HTTP-layer tests (helpers in sim_rig.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from sim_rig import CLIENT_TIMEOUT, PROFILE, Sims

from pdserve.sim.faults import FaultSpec
from pdserve.sim.fleet import SimInstanceSpec, sim_in_thread


@pytest.fixture(scope="session")
def _session_sims() -> Iterator[Sims]:
    specs = [SimInstanceSpec("prefill"), SimInstanceSpec("decode"), SimInstanceSpec("both")]
    with sim_in_thread(specs, PROFILE) as cluster:
        yield Sims(cluster, *cluster.urls)


@pytest.fixture
def sims(_session_sims: Sims) -> Sims:
    """The session's prefill, decode and colocated instances, with every fault cleared."""
    for inst in _session_sims.cluster.instances:
        inst.faults.set(FaultSpec())
    return _session_sims


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as session:
        yield session

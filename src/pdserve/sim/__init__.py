"""pdserve sim: vLLM-compatible engine instances (NixlConnector PD protocol) with modelled timing.

For scale, fault and routing-policy tests; real vLLM stays the proof that something works.
"""

from pdserve.sim.api import create_sim_app
from pdserve.sim.cli import main
from pdserve.sim.faults import FaultSpec
from pdserve.sim.instance import SimInstance
from pdserve.sim.server import SimInstanceSpec, run_sim, sim_in_thread

__all__ = [
    "FaultSpec",
    "SimInstance",
    "SimInstanceSpec",
    "create_sim_app",
    "main",
    "run_sim",
    "sim_in_thread",
]

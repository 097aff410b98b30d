"""Stage 1, topology: communicators that mirror the machine (world -> switch -> node -> rank),
the leaders' communicators, and hierarchical collectives over them."""

from .comms import Topology, build_topology
from .discover import parse_slurm_topology

__all__ = ["Topology", "build_topology", "parse_slurm_topology"]

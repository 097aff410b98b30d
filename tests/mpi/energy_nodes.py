"""MPI test: the energy meter reads each host's counters once and sums them over hosts.

usage: energy_nodes.py ROOT RANKS_PER_NODE HOSTS OUT
  ROOT/node<N>: a fake powercap tree for (simulated) node N; each package domain holds a
  ``next_uj`` file: the node's reader copies it to ``energy_uj`` between opening the meter and
  reading it (the energy used in between, wrap-around included).
  HOSTS = "one": the simulated nodes keep their names (one real host: only node 0 reads);
  "many": every simulated node is named as a host of its own (each node leader reads).
  OUT: rank 0 writes the reading and what every rank saw there as JSON.
"""

import json
import sys
from pathlib import Path

from mpi4py import MPI

from semzo.deck import TopologySection
from semzo.energy import EnergyMeter
from semzo.runtime import run_spmd
from semzo.topology import build_topology


def main():
    root, rpn, hosts, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    topo = build_topology(MPI.COMM_WORLD, TopologySection(ranks_per_node=rpn))
    if hosts == "many":
        topo.node_names = [f"host{n}" for n in range(topo.n_nodes)]
    meter = EnergyMeter(topo, powercap=root / f"node{topo.node_id}")
    topo.world.Barrier()
    if meter.reader:
        for d in sorted((root / f"node{topo.node_id}").glob("intel-rapl:*")):
            if (d / "next_uj").is_file():
                (d / "energy_uj").write_text((d / "next_uj").read_text())
    work = sum(float(i) ** 0.5 for i in range(200_000))          # some CPU time to count
    topo.world.Barrier()
    got = meter.read()
    seen = topo.world.allgather((got.cpu_j, got.gpu_j, got.core_s, meter.reader))
    if topo.rank == 0:
        Path(out).write_text(json.dumps({"cpu_j": got.cpu_j, "joules": got.joules,
                                         "gpu_j": got.gpu_j, "core_s": got.core_s,
                                         "seen": seen, "described": meter.describe(),
                                         "n_hosts": meter.n_hosts, "work": work > 0}))
    meter.close()
    topo.free()


if __name__ == "__main__":
    run_spmd(main)

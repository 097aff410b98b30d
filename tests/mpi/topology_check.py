"""MPI test: build a topology from deck overrides, check its communicators and that the
hierarchical collectives equal flat MPI (integers bit for bit, floats within rounding).

usage: topology_check.py RANKS_PER_NODE NODES_PER_SWITCH EXPECT_NODES EXPECT_SWITCHES [SOURCE]
"""

import sys

import numpy as np
from mpi4py import MPI

from semzo.deck import TopologySection
from semzo.runtime import run_spmd
from semzo.topology import build_topology


def main():
    rpn, nps, exp_nodes, exp_switches = map(int, sys.argv[1:5])
    switch_source = sys.argv[5] if len(sys.argv) > 5 else None
    comm = MPI.COMM_WORLD
    topo = build_topology(comm, TopologySection(ranks_per_node=rpn, nodes_per_switch=nps))
    P, r = topo.size, topo.rank
    assert topo.n_nodes == exp_nodes, (topo.n_nodes, exp_nodes)
    assert topo.n_switches == exp_switches, (topo.n_switches, exp_switches)
    if switch_source:
        assert topo.switch_source == switch_source, topo.switch_source
    # communicator sizes agree with the maps
    assert topo.node.Get_size() == int(np.sum(topo.rank_node == topo.node_id))
    same_switch = topo.node_switch[topo.rank_node] == topo.switch_id
    assert topo.switch.Get_size() == int(same_switch.sum())
    if topo.is_node_leader:
        assert topo.node_leaders is not None
        assert topo.node_leaders.Get_size() == int(np.sum(topo.node_switch == topo.switch_id))
    else:
        assert topo.node_leaders is None
    if topo.is_switch_leader:
        assert topo.switch_leaders.Get_size() == topo.n_switches
    else:
        assert topo.switch_leaders is None
    # world is a duplicate, not COMM_WORLD itself
    assert MPI.Comm.Compare(topo.world, comm) == MPI.CONGRUENT
    if rpn:
        assert topo.node_id == r // rpn

    rng = np.random.default_rng(1000 + r)
    for dtype in (np.int64, np.int32, np.float64, np.float32):
        for n in (1, 3, 1000, 65537):
            if np.dtype(dtype).kind == "i":
                x = rng.integers(-2**20, 2**20, size=n).astype(dtype)
            else:
                x = rng.standard_normal(n).astype(dtype)
            for op in (MPI.SUM, MPI.MAX, MPI.MIN):
                flat = x.copy()
                comm.Allreduce(MPI.IN_PLACE, flat, op=op)
                hier = topo.allreduce(x.copy(), op=op)
                if np.dtype(dtype).kind == "i" or op is not MPI.SUM:
                    assert np.array_equal(hier, flat), (dtype, n, op)
                else:
                    tol = 1e-12 if dtype == np.float64 else 1e-5
                    scale = np.abs(x).max() * P
                    assert np.max(np.abs(hier - flat)) <= tol * scale, (dtype, n)
            # allgather, 2-D blocks, world-rank order
            block = np.full((2, 3), r, dtype=dtype) + np.arange(6, dtype=dtype).reshape(2, 3)
            g = topo.allgather(block)
            assert g.shape == (P, 2, 3)
            for q in range(P):
                assert np.array_equal(g[q], np.full((2, 3), q, dtype=dtype)
                                      + np.arange(6, dtype=dtype).reshape(2, 3))
    # broadcast from every root
    for root in range(P):
        b = np.arange(17, dtype=np.float64) * (root + 1) if r == root else np.zeros(17)
        topo.bcast(b, root=root)
        assert np.array_equal(b, np.arange(17, dtype=np.float64) * (root + 1)), root
    desc = topo.describe()
    assert desc.count("\n") == P + 1
    if r == 0:
        print(desc)
        print("TOPOLOGY-OK", topo.n_nodes, topo.n_switches)
    topo.free()


if __name__ == "__main__":
    run_spmd(main)

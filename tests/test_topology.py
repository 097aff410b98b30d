"""Topology: Slurm parsing, simulated and discovered hierarchies at 1, 2 and 4 ranks,
hierarchical collectives against flat MPI, and the never-hang error policy."""

import time

import pytest
from mpiutil import check, mpirun

from semzo.deck import DeckError
from semzo.topology.discover import (
    group_nodes,
    number_keys,
    parse_slurm_topology,
    simulated_layout,
    slurm_switch_key,
)

SCRIPT = "tests/mpi/topology_check.py"


@pytest.mark.parametrize("addr,pattern,switch,node", [
    ("root.s1.s7.node42", "switch.switch.switch.node", "root.s1.s7", "node42"),
    ("s0.nid00012", "switch.node", "s0", "nid00012"),
    ("core.leaf03.cn-0117", "switch.switch.node", "core.leaf03", "cn-0117"),
    ("ib-spine1.ib-leaf2.gpu-a100-12", "switch.switch.node", "ib-spine1.ib-leaf2",
     "gpu-a100-12"),
    ("node007", "node", "", "node007"),            # no tree plugin: just the node name
])
def test_parse_slurm_topology(addr, pattern, switch, node):
    assert parse_slurm_topology(addr, pattern) == (switch, node)


def test_slurm_env_and_mismatch():
    env = {"SLURM_TOPOLOGY_ADDR": "top.sw2.n5", "SLURM_TOPOLOGY_ADDR_PATTERN":
           "switch.switch.node"}
    assert slurm_switch_key(env) == "top.sw2"
    assert slurm_switch_key({}) is None
    assert slurm_switch_key({"SLURM_TOPOLOGY_ADDR": "n5",
                             "SLURM_TOPOLOGY_ADDR_PATTERN": "node"}) is None
    with pytest.raises(ValueError, match="does not match"):
        parse_slurm_topology("a.b.c", "switch.node")


def test_layout_helpers():
    assert simulated_layout(4, 1, 2) == ([0, 1, 2, 3], [0, 0, 1, 1])
    assert simulated_layout(4, 2, 0) == ([0, 0, 1, 1], [0, 0])
    with pytest.raises(DeckError, match="topology.ranks_per_node"):
        simulated_layout(4, 3, 0)
    with pytest.raises(DeckError, match="topology.nodes_per_switch"):
        group_nodes(4, 3)
    assert number_keys(["b", "b", "a", "c", "a"]) == [0, 0, 1, 2, 1]


@pytest.mark.parametrize("np_,rpn,nps,nodes,switches", [
    (4, 1, 2, 4, 2),    # 2 switches x 2 nodes x 1 rank
    (4, 2, 2, 2, 1),    # 1 switch x 2 nodes x 2 ranks
    (4, 2, 1, 2, 2),    # 2 switches x 1 node x 2 ranks
    (4, 1, 1, 4, 4),
    (4, 4, 0, 1, 1),
    (4, 0, 0, 1, 1),    # discovered: one host = one node
    (2, 1, 1, 2, 2),
    (2, 0, 0, 1, 1),
    (1, 1, 1, 1, 1),
    (1, 0, 0, 1, 1),
])
def test_hierarchies_mpi(np_, rpn, nps, nodes, switches):
    proc = check(mpirun(np_, [SCRIPT, str(rpn), str(nps), str(nodes), str(switches)],
                        timeout=90))
    assert f"TOPOLOGY-OK {nodes} {switches}" in proc.stdout


def test_slurm_switches_mpi():
    env = {"SLURM_TOPOLOGY_ADDR": "root.leaf1.host1",
           "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    proc = check(mpirun(2, [SCRIPT, "0", "0", "1", "1", "slurm"], timeout=60, env=env))
    assert "TOPOLOGY-OK" in proc.stdout


def test_topology_command_prints_hierarchy():
    proc = check(mpirun(4, ["-m", "semzo", "topology", "inputs/demo.toml"], timeout=60))
    out = proc.stdout
    assert "4 ranks, 4 nodes (deck), 2 switches (deck)" in out
    assert out.count("switch-leader") == 2 and out.count("node-leader") == 4


@pytest.mark.parametrize("bad", [0, 2, 3])
def test_exception_on_one_rank_ends_all(bad):
    t0 = time.monotonic()
    proc = mpirun(4, ["tests/mpi/raise_on_one_rank.py", str(bad)], timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < 20, took
    err = proc.stderr
    assert err.count(f"injected failure on rank {bad}") >= 1
    assert err.count("error: rank") == 1, err
    assert f"rank {bad} of 4 raised ValueError" in err

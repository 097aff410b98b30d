"""The :class:`Topology`: communicators mirroring world -> switch -> node -> rank."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..deck import DeckError, TopologySection
from . import collectives
from .discover import group_nodes, number_keys, simulated_layout, slurm_switch_key


@dataclass(eq=False)
class Topology:
    """Communicators and maps of one run's hierarchy. Build with :func:`build_topology`.

    ``world`` is a duplicate of the communicator given, so library messages never meet the
    user's. ``node_leaders`` holds the node leaders (node-local rank 0) of one switch and is
    ``None`` on other ranks; ``switch_leaders`` holds one leader per switch (its lowest rank)
    and is ``None`` elsewhere. Node ids and switch ids number nodes and switches in order of
    their lowest world rank.
    """

    world: MPI.Intracomm
    node: MPI.Intracomm
    switch: MPI.Intracomm
    node_leaders: MPI.Intracomm | None
    switch_leaders: MPI.Intracomm | None
    rank_node: np.ndarray          # (P,) node id of each world rank
    node_switch: np.ndarray        # (n_nodes,) switch id of each node
    node_names: list[str]
    node_source: str               # "deck", "shared-memory"
    switch_source: str             # "deck", "slurm", "single"
    hierarchical: bool = True
    gather_order: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        P = self.size
        self.node_leader_of = np.array([np.flatnonzero(self.rank_node == n)[0]
                                        for n in range(self.n_nodes)])
        ranks_switch = self.node_switch[self.rank_node]
        self.switch_leader_of = np.array([np.flatnonzero(ranks_switch == s)[0]
                                          for s in range(self.n_switches)])
        # order in which ranks' blocks arrive in a hierarchical gather
        self.gather_order = np.array(sorted(range(P), key=lambda r: (
            ranks_switch[r], self.rank_node[r], r)))
        pos = {int(r): i for i, r in enumerate(self.gather_order)}
        self.node_offset = pos[int(self.node_leader_of[self.node_id])]
        self.switch_offset = pos[int(self.switch_leader_of[self.switch_id])]
        nodes_here = np.flatnonzero(self.node_switch == self.switch_id)
        self.switch_node_sizes = np.bincount(self.rank_node, minlength=self.n_nodes)[nodes_here]
        self.switch_size = int(self.switch_node_sizes.sum())
        self.switch_sizes = np.bincount(ranks_switch, minlength=self.n_switches)

    # ---- where am I ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def size(self) -> int:
        return self.world.Get_size()

    @property
    def n_nodes(self) -> int:
        return len(self.node_switch)

    @property
    def n_switches(self) -> int:
        return int(self.node_switch.max()) + 1

    @property
    def node_id(self) -> int:
        return int(self.rank_node[self.rank])

    @property
    def switch_id(self) -> int:
        return int(self.node_switch[self.node_id])

    @property
    def local_rank(self) -> int:
        return self.node.Get_rank()

    @property
    def local_size(self) -> int:
        return self.node.Get_size()

    @property
    def is_node_leader(self) -> bool:
        return self.node.Get_rank() == 0

    @property
    def is_switch_leader(self) -> bool:
        return self.rank == int(self.switch_leader_of[self.switch_id])

    def node_local_rank_of(self, world_rank: int) -> int:
        """Rank of ``world_rank`` inside its node communicator."""
        same = np.flatnonzero(self.rank_node == self.rank_node[world_rank])
        return int(np.searchsorted(same, world_rank))

    def node_leader_index(self, node: int) -> int:
        """Rank of ``node``'s leader inside its switch's node-leaders communicator."""
        peers = np.flatnonzero(self.node_switch == self.node_switch[node])
        return int(np.searchsorted(peers, node))

    # ---- collectives (all collective over world) ------------------------------------------
    def allreduce(self, buf, op: MPI.Op = MPI.SUM):
        """In-place hierarchical allreduce of a contiguous array; see collectives.allreduce."""
        return collectives.allreduce(self, buf, op)

    def allgather(self, sendbuf):
        """Hierarchical allgather into ``(P, *shape)`` in world-rank order."""
        return collectives.allgather(self, sendbuf)

    def bcast(self, buf, root: int = 0):
        """In-place hierarchical broadcast from world rank ``root``."""
        return collectives.bcast(self, buf, root)

    def describe(self) -> str:
        """A table: rank, node, switch, leader roles (the same text on every rank)."""
        lines = [(f"topology: {self.size} ranks, {self.n_nodes} nodes ({self.node_source}), "
                  f"{self.n_switches} switches ({self.switch_source}), collectives "
                  f"{'hierarchical' if self.hierarchical else 'flat'}"),
                 f"{'rank':>5} {'node':>5} {'switch':>7}  {'host':<20} roles"]
        for r in range(self.size):
            n = int(self.rank_node[r])
            s = int(self.node_switch[n])
            roles = []
            if r == self.switch_leader_of[s]:
                roles.append("switch-leader")
            if r == self.node_leader_of[n]:
                roles.append("node-leader")
            lines.append(f"{r:>5} {n:>5} {s:>7}  {self.node_names[n]:<20} "
                         f"{','.join(roles) or '-'}")
        return "\n".join(lines)

    def free(self) -> None:
        """Free every communicator this object created. Collective over the world."""
        for c in (self.node_leaders, self.switch_leaders, self.switch, self.node, self.world):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()


def build_topology(comm: MPI.Intracomm, cfg: TopologySection | None = None, *,
                   src: str = "<deck>", env: Mapping[str, str] | None = None) -> Topology:
    """Discover the hierarchy and build its communicators. Collective over ``comm``.

    Raises :class:`DeckError` (the same on every rank) when the deck's simulated hierarchy does
    not divide the world, and ``RuntimeError`` when ranks disagree about their node's switch.
    """
    cfg = cfg or TopologySection()
    env = os.environ if env is None else env
    world = comm.Dup()
    size, rank = world.Get_size(), world.Get_rank()
    host = MPI.Get_processor_name()

    if cfg.ranks_per_node > 0:
        try:
            rank_node, node_switch = simulated_layout(size, cfg.ranks_per_node,
                                                      cfg.nodes_per_switch, src)
        except DeckError:
            world.Free()
            raise
        node_source = "deck"
        switch_source = "deck" if cfg.nodes_per_switch > 0 else "single"
        names = world.allgather(host)
        node_names = [f"{names[rank_node.index(n)]}/sim{n}" for n in range(max(rank_node) + 1)]
    else:
        shm = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        node_key = shm.allreduce(rank, op=MPI.MIN)
        shm.Free()
        try:
            sw = slurm_switch_key(env)
            err = None
        except ValueError as exc:
            sw, err = None, str(exc)
        info = world.allgather((node_key, host, sw, err))
        errs = [e for *_, e in info if e]
        if errs:
            world.Free()
            raise DeckError(f"environment: {errs[0]}")
        rank_node = number_keys([k for k, *_ in info])
        n_nodes = max(rank_node) + 1
        first = [rank_node.index(n) for n in range(n_nodes)]
        node_names = [info[r][1] for r in first]
        node_source = "shared-memory"
        if cfg.nodes_per_switch > 0:
            try:
                node_switch = group_nodes(n_nodes, cfg.nodes_per_switch, src)
            except DeckError:
                world.Free()
                raise
            switch_source = "deck"
        elif all(s is not None for *_, s, _ in info):
            node_sw = [info[r][2] for r in first]
            for r in range(size):
                if info[r][2] != node_sw[rank_node[r]]:
                    world.Free()
                    raise RuntimeError(f"ranks of node {node_names[rank_node[r]]} disagree on "
                                       f"SLURM_TOPOLOGY_ADDR: {info[r][2]!r} vs "
                                       f"{node_sw[rank_node[r]]!r}")
            node_switch = number_keys(node_sw)
            switch_source = "slurm"
        else:
            node_switch = [0] * n_nodes
            switch_source = "single"

    rank_node_a = np.asarray(rank_node, dtype=np.int64)
    node_switch_a = np.asarray(node_switch, dtype=np.int64)
    my_node = int(rank_node_a[rank])
    my_switch = int(node_switch_a[my_node])
    node = world.Split(color=my_node, key=rank)
    switch = world.Split(color=my_switch, key=rank)
    is_nl = node.Get_rank() == 0
    node_leaders = world.Split(color=my_switch if is_nl else MPI.UNDEFINED, key=rank)
    is_sl = is_nl and node_leaders.Get_rank() == 0
    switch_leaders = world.Split(color=0 if is_sl else MPI.UNDEFINED, key=rank)
    return Topology(
        world=world, node=node, switch=switch,
        node_leaders=None if node_leaders == MPI.COMM_NULL else node_leaders,
        switch_leaders=None if switch_leaders == MPI.COMM_NULL else switch_leaders,
        rank_node=rank_node_a, node_switch=node_switch_a, node_names=node_names,
        node_source=node_source, switch_source=switch_source,
        hierarchical=cfg.collectives == "hierarchical")

"""Where each rank sits: (switch, node) keys from the deck, Slurm, or MPI shared memory.

Pure functions (no MPI) so the parsing can be tested without a launcher.
Discovery order (first that applies wins, separately for nodes and switches):

nodes:    deck ``topology.ranks_per_node`` > 0  -> consecutive blocks of world ranks
          otherwise                             -> ``MPI_COMM_TYPE_SHARED`` (the real node)
switches: deck ``topology.nodes_per_switch`` > 0 -> consecutive blocks of nodes
          ``SLURM_TOPOLOGY_ADDR`` + ``..._PATTERN`` (tree plugin) -> the leaf switch path
          otherwise                              -> one switch for the whole job
"""

from __future__ import annotations

from collections.abc import Mapping

from ..deck import DeckError


def parse_slurm_topology(addr: str, pattern: str) -> tuple[str, str]:
    """Split a Slurm topology address into (switch path, node name).

    ``addr`` is ``SLURM_TOPOLOGY_ADDR`` (e.g. ``root.s1.s7.node42``) and ``pattern`` is
    ``SLURM_TOPOLOGY_ADDR_PATTERN`` (e.g. ``switch.switch.switch.node``). The switch path joins
    every ``switch`` component, so two nodes share a switch exactly when they hang from the
    same leaf switch. Without switch components (no tree plugin) the switch path is ``""``.
    Raises ``ValueError`` when the two do not have the same number of components.
    """
    parts = addr.strip().split(".")
    kinds = pattern.strip().split(".")
    if len(parts) != len(kinds) or not addr.strip():
        raise ValueError(f"SLURM_TOPOLOGY_ADDR={addr!r} does not match "
                         f"SLURM_TOPOLOGY_ADDR_PATTERN={pattern!r}")
    switches = [p for p, k in zip(parts, kinds) if k == "switch"]
    nodes = [p for p, k in zip(parts, kinds) if k == "node"]
    node = nodes[-1] if nodes else parts[-1]
    return ".".join(switches), node


def slurm_switch_key(env: Mapping[str, str]) -> str | None:
    """The leaf-switch path from Slurm's environment, or ``None`` if Slurm gives none."""
    addr = env.get("SLURM_TOPOLOGY_ADDR")
    pattern = env.get("SLURM_TOPOLOGY_ADDR_PATTERN")
    if not addr or not pattern:
        return None
    switch, _ = parse_slurm_topology(addr, pattern)
    return switch or None


def simulated_layout(size: int, ranks_per_node: int, nodes_per_switch: int,
                     src: str = "<deck>") -> tuple[list[int], list[int]]:
    """Node of each rank and switch of each node for a deck-simulated hierarchy.

    ``ranks_per_node`` = 0 means "not simulated" and is handled by the caller. Raises
    :class:`DeckError` naming the key when the numbers do not divide evenly.
    """
    if ranks_per_node <= 0:
        raise ValueError("simulated_layout needs ranks_per_node > 0")
    if size % ranks_per_node:
        raise DeckError(f"{src}: topology.ranks_per_node: {size} ranks cannot be split into "
                        f"nodes of {ranks_per_node} ranks")
    n_nodes = size // ranks_per_node
    rank_node = [r // ranks_per_node for r in range(size)]
    node_switch = group_nodes(n_nodes, nodes_per_switch, src)
    return rank_node, node_switch


def group_nodes(n_nodes: int, nodes_per_switch: int, src: str = "<deck>") -> list[int]:
    """Switch of each node when the deck groups consecutive nodes (0 = all on one switch)."""
    if nodes_per_switch <= 0:
        return [0] * n_nodes
    if n_nodes % nodes_per_switch:
        raise DeckError(f"{src}: topology.nodes_per_switch: {n_nodes} nodes cannot be split "
                        f"into switches of {nodes_per_switch} nodes")
    return [n // nodes_per_switch for n in range(n_nodes)]


def number_keys(keys: list) -> list[int]:
    """Map keys to 0, 1, ... in order of first appearance (rank order): stable ids."""
    ids: dict = {}
    return [ids.setdefault(k, len(ids)) for k in keys]

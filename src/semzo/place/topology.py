"""The placement view of the machine: a tree switch -> node -> rank, built from two arrays.

``rank_node (P,)``: node id of each rank (ids ``0..n_nodes-1``; ranks of a node need not be
contiguous). ``node_switch (n_nodes,)``: switch id of each node (any integers). Nodes without
ranks are left out. Children are ordered by id, ranks by rank number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TreeNode:
    """A switch, a node or a rank: ``ranks`` (sorted int64) below it and its ``children``."""

    ident: int
    ranks: np.ndarray
    children: list[TreeNode] = field(default_factory=list)

    @property
    def n_ranks(self) -> int:
        return int(self.ranks.size)


def check_topology(rank_node: np.ndarray, node_switch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validated int64 copies of ``rank_node`` and ``node_switch`` (ValueError if inconsistent)."""
    rank_node = np.asarray(rank_node, dtype=np.int64).reshape(-1)
    node_switch = np.asarray(node_switch, dtype=np.int64).reshape(-1)
    if rank_node.size == 0:
        raise ValueError("rank_node is empty")
    if rank_node.min() < 0 or rank_node.max() >= node_switch.size:
        raise ValueError(f"rank_node values must lie in [0, {node_switch.size}) "
                         f"(node_switch has {node_switch.size} entries)")
    return rank_node, node_switch


def build_tree(rank_node: np.ndarray, node_switch: np.ndarray) -> TreeNode:
    """Root (ident -1) -> switches -> nodes -> ranks (leaves, ident = rank)."""
    rank_node, node_switch = check_topology(rank_node, node_switch)
    ranks = np.arange(rank_node.size, dtype=np.int64)
    rank_switch = node_switch[rank_node]
    root = TreeNode(-1, ranks)
    for s in np.unique(rank_switch):
        sw = TreeNode(int(s), ranks[rank_switch == s])
        for n in np.unique(rank_node[sw.ranks]):
            nd = TreeNode(int(n), ranks[rank_node == n])
            nd.children = [TreeNode(int(r), np.array([r], dtype=np.int64)) for r in nd.ranks]
            sw.children.append(nd)
        root.children.append(sw)
    return root


def rank_groups(rank_node: np.ndarray, node_switch: np.ndarray) -> list[np.ndarray]:
    """Group id of each rank per level, finest first: ``[node, switch, whole machine]``."""
    rank_node, node_switch = check_topology(rank_node, node_switch)
    return [rank_node, node_switch[rank_node], np.zeros_like(rank_node)]

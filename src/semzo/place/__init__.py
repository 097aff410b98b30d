"""Placement of clusters on ranks and redistribution of rows (see plan.py, flows.py,
shuffle.py, redistribute.py)."""

from semzo.place.flows import (
    cluster_counts,
    destinations,
    format_figures,
    movement,
    plan_figures,
    within_rank_distance,
)
from semzo.place.plan import Placement, place, placement_from_quota
from semzo.place.shuffle import movement_from_dest, shuffle_destinations

__all__ = ["Placement", "cluster_counts", "destinations", "format_figures", "movement",
           "movement_from_dest", "place", "placement_from_quota", "plan_figures",
           "shuffle_destinations", "within_rank_distance"]

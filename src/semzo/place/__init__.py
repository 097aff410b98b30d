"""Placement of clusters on ranks and redistribution of rows (see plan.py, flows.py,
redistribute.py)."""

from semzo.place.flows import (
    cluster_counts,
    destinations,
    format_figures,
    movement,
    plan_figures,
    within_rank_distance,
)
from semzo.place.plan import Placement, place

__all__ = ["Placement", "cluster_counts", "destinations", "format_figures", "movement",
           "place", "plan_figures", "within_rank_distance"]

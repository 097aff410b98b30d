"""Parallel k-means over MPI ranks (k-means|| init, Lloyd or exact pruned Lloyd).

``from semzo.cluster import kmeans, KMeansResult, predict``; see :mod:`semzo.cluster.kmeans`.
"""

from .init import hash_uniform
from .kmeans import ALGORITHMS, KMeansResult, init_centers, kmeans, predict

__all__ = ["ALGORITHMS", "KMeansResult", "hash_uniform", "init_centers", "kmeans", "predict"]

"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The schedule is a pure function of the step (no state to checkpoint beyond the step itself).
"""

from __future__ import annotations

import math

KINDS = ("constant", "linear", "cosine")


def lr_at(step: int, total: int, base: float, kind: str = "constant", warmup: int = 0,
          min_ratio: float = 0.0) -> float:
    """Learning rate of 0-based ``step`` in a run of ``total`` steps.

    Warm-up: ``base * (step + 1) / warmup`` for ``step < warmup``. Afterwards, with
    ``p = (step - warmup) / max(1, total - warmup - 1)`` in [0, 1]:
    constant ``base``; linear ``base * (1 - (1 - m) p)``; cosine
    ``base * (m + (1 - m) (1 + cos(pi p)) / 2)``, where ``m = min_ratio`` (so the last step
    runs at ``m * base``).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(KINDS)}")
    if step < warmup:
        return base * (step + 1) / warmup
    if kind == "constant":
        return base
    p = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup - 1)))
    m = min_ratio
    if kind == "linear":
        return base * (1.0 - (1.0 - m) * p)
    return base * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p)))

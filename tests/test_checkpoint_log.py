"""The checkpoint log (issue 12, defect 7): one INFO line per save, deletions at DEBUG."""

from __future__ import annotations

import logging
import sys

from mpi4py import MPI
from mpiutil import ROOT

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from ckpt_common import BLOCK_KIB, params, state

from semzo import deck as deckmod
from semzo.checkpoint import Checkpointer
from semzo.deck import CheckpointSection


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_first_save_and_a_summary_at_info_deletions_at_debug(tmp_path):
    root = logging.getLogger("semzo")
    h, old = _Records(), root.level
    root.addHandler(h)
    root.setLevel(logging.DEBUG)
    try:
        cfg = CheckpointSection(dir=str(tmp_path), keep=2, block_kib=BLOCK_KIB)
        with Checkpointer(MPI.COMM_SELF, cfg, deck_toml=deckmod.load(None).to_toml()) as ck:
            for s in range(1, 6):
                ck.save(s, params(s), state(s))
    finally:
        root.removeHandler(h)
        root.setLevel(old)
    mine = [r for r in h.records if r.name.startswith("semzo.checkpoint")]
    info = [r.getMessage() for r in mine if r.levelno >= logging.INFO]
    debug = [r.getMessage() for r in mine if r.levelno == logging.DEBUG]
    # the first save and a summary at close (not one line per save: a demo saved 40 times)
    assert len(info) == 2, info
    assert info[0].startswith("checkpoint step 1: ") and "later saves" in info[0], info
    assert info[1].startswith("checkpoints: 5 saved in ") and "(steps 1..5)" in info[1], info
    assert sum(m.startswith("checkpoint step ") for m in debug) == 4, debug
    assert sum("removed old checkpoint" in m for m in debug) == 3, debug   # 5 saves, keep 2

"""checkpoint.async_save decides once, at the first save, between a background and a
synchronous write from the free cores and the measured load
(semzo.checkpoint.manager.choose_async)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from mpi4py import MPI

from semzo.checkpoint import Checkpointer, load, manager
from semzo.deck import CheckpointSection


@pytest.mark.parametrize("cores,ranks,threads,want", [
    (2, 4, 1, False),      # the CI machine: 4 ranks on 2 cores
    (2, 2, 1, False),      # every core taken
    (2, 1, 2, False),      # one rank whose numba/BLAS threads use both cores
    (2, 1, 1, True),       # one core free
    (16, 4, 2, True),
    (8, 8, 1, False),
    (1, 1, 1, False),
])
def test_background_only_with_a_free_core(cores, ranks, threads, want):
    ok, why = manager.choose_async(cores, ranks, threads)
    assert ok is want
    assert f"{cores} cores for {ranks} ranks x {threads}" in why
    assert ("free, so the write goes on in the background" in why) is want
    assert ("no free core" in why) is not want


@pytest.mark.parametrize("cores,ranks,threads,load,want", [
    (2, 1, 1, 1.0, True),      # our rank alone: one core free
    (2, 1, 1, 1.4, True),
    (2, 1, 1, 1.6, False),     # other work takes the second core
    (2, 1, 1, 11.0, False),    # a shared machine (the development one)
    (16, 4, 2, 9.0, True),     # 16 - 9: seven free
    (16, 4, 2, 15.7, False),
])
def test_the_measured_load_counts_as_busy_cores(cores, ranks, threads, load, want):
    ok, why = manager.choose_async(cores, ranks, threads, "", load)
    assert ok is want
    assert f"load average {load:.1f}" in why
    assert ("other work keeps them busy" in why) is (not want and load > ranks * threads)


def test_override():
    assert manager.choose_async(2, 4, 1, "always")[0] is True
    assert manager.choose_async(64, 1, 1, "never")[0] is False
    assert manager.choose_async(2, 4, 1, "bogus")[0] is False


def test_compute_threads_reads_the_limits(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert manager.compute_threads() >= 7


@pytest.mark.skipif(MPI.Query_thread() < MPI.THREAD_MULTIPLE, reason="needs MPI threads")
@pytest.mark.parametrize("cores,want", [(1, "synchronous"), (64, "asynchronous")])
def test_decided_once_at_the_first_save_and_logged(tmp_path, monkeypatch, caplog, cores, want):
    monkeypatch.delenv(manager.ASYNC_ENV, raising=False)
    monkeypatch.setattr(manager, "_node_cores", lambda comm: (cores, 1, 1, 0.0))
    calls = []
    real = manager.choose_async
    monkeypatch.setattr(manager, "choose_async", lambda *a: calls.append(a) or real(*a))
    p = {"w": np.arange(1000, dtype=np.float32)}
    caplog.set_level(logging.INFO, logger="semzo")
    cfg = CheckpointSection(dir=str(tmp_path), keep=2, async_save=True)
    with Checkpointer(MPI.COMM_WORLD, cfg) as ck:
        assert ck.background is False                   # not decided before the first save
        ck.save(1, p)
        threaded = ck._thread is not None
        ck.save(2, p)
        assert ck.background is threaded
    assert len(calls) == 1 and threaded is (want == "asynchronous")
    assert caplog.text.count("checkpoint.async_save: ") == 1
    assert f"checkpoint.async_save: {want}" in caplog.text
    assert load(tmp_path / "ckpt-000000002.h5", MPI.COMM_WORLD).params["w"].tobytes() \
        == p["w"].tobytes()

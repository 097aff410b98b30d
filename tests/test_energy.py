"""Energy meters (semzo/energy.py): RAPL against fake powercap trees (two packages, wrap-around,
unreadable files), NVML against a fake module (counter, NotSupported, no driver), the meter's
"not measured" rule, the sum once per host under mpirun at 2 and 4 ranks, and joules to a
target in the experiment analysis (with metrics.csv files of an older release)."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from mpiutil import check, mpirun

from semzo.energy import EnergyMeter, Nvml, Rapl, Reading, host_of, summary
from semzo.experiment.analysis import Run, read_metrics, use_to_target
from semzo.finetune.report import COLUMNS, _read_rows

SCRIPT = "tests/mpi/energy_nodes.py"


def powercap(root: Path, packages: dict[int, tuple[int, int]], sub: bool = True) -> Path:
    """A fake /sys/class/powercap: ``packages`` = {N: (energy_uj, max_energy_range_uj)}, each
    with a core sub-domain (not to be added again) and an MMIO twin (ignored)."""
    for n, (e, mx) in packages.items():
        d = root / f"intel-rapl:{n}"
        d.mkdir(parents=True)
        (d / "name").write_text(f"package-{n}\n")
        (d / "energy_uj").write_text(f"{e}\n")
        (d / "max_energy_range_uj").write_text(f"{mx}\n")
        if sub:
            s = root / f"intel-rapl:{n}:0"
            s.mkdir()
            (s / "energy_uj").write_text("999999\n")
            (s / "max_energy_range_uj").write_text(f"{mx}\n")
    m = root / "intel-rapl-mmio:0"
    m.mkdir(exist_ok=True)
    (m / "energy_uj").write_text("123456789\n")
    return root


def set_uj(root: Path, n: int, v: int) -> None:
    (root / f"intel-rapl:{n}" / "energy_uj").write_text(f"{v}\n")


# ----------------------------------------------------------------------------- RAPL
def test_rapl_sums_package_domains_across_wraparound(tmp_path):
    root = powercap(tmp_path, {0: (1_000, 10_000_000), 1: (9_990_000, 10_000_000)})
    r = Rapl(root)
    assert r.ok and r.domains == 2 and r.reason == ""
    assert r.poll() == 0.0
    set_uj(root, 0, 2_001_000)                  # +2.0 J
    set_uj(root, 1, 10_000)                      # wrapped: +20_000 uJ = +0.02 J
    assert r.poll() == pytest.approx(2.02, abs=1e-12)
    set_uj(root, 0, 500_000)                     # wrapped again: +8_499_000 uJ
    assert r.poll() == pytest.approx(2.02 + 8.499, abs=1e-12)
    assert r.poll() == pytest.approx(10.519, abs=1e-12)           # no change, no drift


def test_rapl_missing_or_empty_tree_is_not_measured(tmp_path):
    r = Rapl(tmp_path / "absent")
    assert not r.ok and "absent" in r.reason
    empty = tmp_path / "empty"
    empty.mkdir()
    r = Rapl(empty)
    assert not r.ok and "no RAPL package domain" in r.reason
    assert r.poll() == 0.0                       # nothing to read, nothing counted


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_rapl_unreadable_counter_is_not_measured(tmp_path):
    root = powercap(tmp_path, {0: (1, 100), 1: (2, 100)})
    (root / "intel-rapl:1" / "energy_uj").chmod(0o200)
    r = Rapl(root)
    assert not r.ok and r.reason.endswith("intel-rapl:1/energy_uj: permission denied")


def test_rapl_unreadable_counter_is_not_measured_as_root_too(tmp_path, monkeypatch):
    """Since Linux 5.10 energy_uj is root-only: a PermissionError however it arises."""
    root = powercap(tmp_path, {0: (1, 100)})
    from semzo import energy

    real = energy._read_int

    def deny(path):
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(energy, "_read_int", deny)
    r = Rapl(root)
    assert not r.ok and r.reason.endswith("energy_uj: permission denied")


def test_rapl_counter_that_turns_unreadable_raises(tmp_path):
    root = powercap(tmp_path, {0: (1, 100)})
    r = Rapl(root)
    (root / "intel-rapl:0" / "energy_uj").write_text("garbage\n")
    with pytest.raises(ValueError):
        r.poll()


# ----------------------------------------------------------------------------- NVML
class FakeNVML:
    """pynvml's functions that energy.py uses; ``mj``: counter per GPU index (mJ)."""

    class NVMLError(Exception):
        pass

    def __init__(self, mj: dict[int, int], unsupported=(), no_driver=False) -> None:
        self.mj, self.unsupported, self.no_driver = dict(mj), set(unsupported), no_driver
        self.inits = self.shutdowns = 0
        self.bus = {f"00000000:{i:02X}:00.0": i for i in mj}

    def nvmlInit(self):
        if self.no_driver:
            raise self.NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", i)

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return ("h", self.bus[bus])

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if h[1] in self.unsupported:
            raise self.NVMLError("Not Supported")
        return self.mj[h[1]]


def test_nvml_counts_each_gpu_once():
    nv = FakeNVML({0: 5_000, 1: 70_000})
    m = Nvml([0, "00000000:01:00.0", 0], nvml=nv)        # GPU 0 twice: two ranks share it
    assert m.ok and m.gpus == [0, "00000000:01:00.0"]
    nv.mj[0] += 1_500
    nv.mj[1] += 250
    assert m.poll() == pytest.approx(1.75)
    nv.mj[1] += 1_000_000
    assert m.poll() == pytest.approx(1001.75)
    m.close()
    m.close()
    assert nv.shutdowns == 1


def test_nvml_not_supported_or_no_driver_is_not_measured():
    nv = FakeNVML({0: 1, 1: 2}, unsupported={1})
    m = Nvml([0, 1], nvml=nv)
    assert not m.ok and "GPU 1" in m.reason and "Not Supported" in m.reason
    assert nv.shutdowns == 1                                   # released at once
    m = Nvml([0], nvml=FakeNVML({0: 1}, no_driver=True))
    assert not m.ok and "Driver Not Loaded" in m.reason
    assert not Nvml([], nvml=FakeNVML({})).ok


# ----------------------------------------------------------------------------- the meter
class OneRank:
    """A one-rank stand-in for semzo.topology.Topology (what EnergyMeter uses)."""

    rank, size = 0, 1
    rank_node = np.array([0])
    node_names = ("hostA/sim0",)

    class world:
        @staticmethod
        def allgather(x):
            return [x]

        @staticmethod
        def bcast(x, root=0):
            return x

    @staticmethod
    def allreduce(buf):
        return buf


def test_meter_without_meters_says_not_measured_and_counts_core_seconds(tmp_path):
    m = EnergyMeter(OneRank(), powercap=tmp_path / "none")
    assert m.reader and not m.cpu and not m.gpu
    assert m.describe().startswith("not measured (RAPL: ") and "core-seconds" in m.describe()
    sum(i * i for i in range(300_000))
    got = m.read()
    assert got.joules is None and got.cpu_j is None and got.core_s > 0
    assert got.row()["energy_j"] is None and got.row()["core_s"] == got.core_s
    s = summary(got, m)
    assert s["energy"].startswith("not measured") and s["CPU core-seconds"] == got.core_s
    assert "energy J" not in s


def test_meter_rapl_and_nvml_on_a_gpu_run(tmp_path):
    root = powercap(tmp_path, {0: (0, 10**9)})
    nv = FakeNVML({0: 0})
    m = EnergyMeter(OneRank(), gpu=0, powercap=root, nvml=nv, poll_s=3600.0)
    assert m.cpu and m.gpu and m.describe() == ("measured: CPU packages by RAPL on 1 host, "
                                                "GPUs by NVML on 1 host")
    set_uj(root, 0, 3_000_000)
    nv.mj[0] = 4_000
    m.poll()                                  # throttled: reads nothing yet
    got = m.read()                            # a read always reads
    assert (got.cpu_j, got.gpu_j, got.joules) == (3.0, 4.0, 7.0)
    s = summary(got, m)
    assert (s["energy J"], s["CPU energy J"], s["GPU energy J"]) == (7.0, 3.0, 4.0)
    m.offset = Reading(10.0, None, 2.0)       # resumed after a run whose GPUs were unmetered
    again = m.read()
    assert again.cpu_j == 13.0 and again.gpu_j is None and again.joules == 13.0
    assert again.core_s >= got.core_s + 2.0
    m.close()
    assert nv.shutdowns == 1


def test_meter_gpu_run_without_nvml_reports_what_it_covers(tmp_path):
    root = powercap(tmp_path, {0: (0, 10**9)})
    m = EnergyMeter(OneRank(), gpu="00000000:00:00.0", powercap=root,
                    nvml=FakeNVML({0: 0}, unsupported={0}))
    assert m.cpu and not m.gpu
    assert "not measured: NVML: GPU 00000000:00:00.0" in m.describe()
    got = m.read()
    assert got.joules == 0.0 and got.gpu_j is None
    assert summary(got, m)["energy covers"] == "CPU packages only (GPUs not measured)"


def test_meter_counter_that_breaks_mid_run_stops_counting(tmp_path):
    root = powercap(tmp_path, {0: (0, 10**9)})
    m = EnergyMeter(OneRank(), powercap=root)
    set_uj(root, 0, 1_000_000)
    assert m.read().joules == 1.0
    (root / "intel-rapl:0" / "energy_uj").unlink()
    assert m.read().joules is None and not m.cpu
    set_uj(root, 0, 2_000_000)
    assert m.read().joules is None                 # never again in this run


@pytest.mark.parametrize("before", ["", "3.0"])
def test_resumed_stage_continues_from_the_kept_rows(tmp_path, monkeypatch, before):
    """A resumed finetune stage's meter starts from the last use its kept metrics rows
    recorded; joules stay "not measured" when the run before the checkpoint had none."""
    from types import SimpleNamespace

    from semzo.finetune.report import Metrics, energy_meter

    root = powercap(tmp_path / "pc", {0: (0, 10**9)})
    monkeypatch.setenv("SEMZO_TEST_POWERCAP", str(root))
    _write(tmp_path / "metrics.csv", COLUMNS,
           [{"kind": "eval", "step": 0, "heldout_loss": 1.0, "core_s": 1.0,
             "energy_j": before and 1.0, "cpu_energy_j": before and 1.0},
            {"kind": "eval", "step": 10, "heldout_loss": 0.9, "core_s": 5.0,
             "energy_j": before, "cpu_energy_j": before},
            {"kind": "eval", "step": 20, "heldout_loss": 0.8, "core_s": 9.0,
             "energy_j": before and 9.0, "cpu_energy_j": before and 9.0}])
    metrics = Metrics(tmp_path, active=True, keep_until=10)    # checkpoint at step 10
    ctx = SimpleNamespace(topo=OneRank(), deck=SimpleNamespace(run=SimpleNamespace(device="cpu")))
    meter = energy_meter(ctx, metrics)
    set_uj(root, 0, 2_000_000)
    got = meter.read()
    assert 5.0 < got.core_s < 9.0
    assert got.joules == (None if before == "" else 5.0)
    assert got.gpu_j is None


def test_host_of_simulated_nodes():
    assert host_of("n01/sim3") == "n01" and host_of("n01") == "n01"
    assert host_of("a/sim/b") == "a/sim/b"


# ----------------------------------------------------------------------------- under MPI
def _nodes(tmp_path, n_nodes: int, broken: bool = False) -> tuple[Path, list[float]]:
    """Fake trees for ``n_nodes`` nodes; returns the root and each node's joules between
    opening and reading (node 0: two packages, one wrapping)."""
    root = tmp_path / "pc"
    used = []
    for n in range(n_nodes):
        pk = {0: (5_000_000 + n, 2**32), 1: (2**32 - 1_000, 2**32)} if n == 0 else \
             {0: (7 * n, 10**12)}
        d = powercap(root / f"node{n}", pk, sub=False)
        if n == 0:
            (d / "intel-rapl:0" / "next_uj").write_text(f"{5_000_000 + 2_500_000}\n")
            (d / "intel-rapl:1" / "next_uj").write_text("4000\n")          # wrapped
            used.append(2.5 + 0.005)
        else:
            (d / "intel-rapl:0" / "next_uj").write_text(f"{7 * n + n * 1_250_000}\n")
            used.append(1.25 * n)
        if broken and n == n_nodes - 1:
            (d / "intel-rapl:0" / "max_energy_range_uj").unlink()
    return root, used


@pytest.mark.parametrize("np_, rpn", [(2, 1), (4, 2)])
@pytest.mark.parametrize("hosts", ["many", "one"])
def test_meter_sums_once_per_host_mpi(tmp_path, np_, rpn, hosts):
    n_nodes = np_ // rpn
    root, used = _nodes(tmp_path, n_nodes)
    out = tmp_path / "out.json"
    check(mpirun(np_, [SCRIPT, str(root), str(rpn), hosts, str(out)], timeout=90))
    got = json.loads(out.read_text())
    readers = [r for r, s in enumerate(got["seen"]) if s[3]]
    if hosts == "many":                     # each node's leader reads its node
        assert readers == [n * rpn for n in range(n_nodes)] and got["n_hosts"] == n_nodes
        assert got["cpu_j"] == pytest.approx(sum(used), abs=1e-9)
    else:                                   # simulated nodes of one host: counted once
        assert readers == [0] and got["n_hosts"] == 1
        assert got["cpu_j"] == pytest.approx(used[0], abs=1e-9)
    assert got["joules"] == got["cpu_j"] and got["gpu_j"] is None
    assert got["described"].startswith("measured: CPU packages by RAPL")
    # every rank holds the same reading; the core-seconds are summed over all ranks
    assert all(s[:3] == got["seen"][0][:3] for s in got["seen"])
    assert got["core_s"] > 0


def test_meter_one_host_unreadable_means_not_measured_mpi(tmp_path):
    root, _ = _nodes(tmp_path, 2, broken=True)
    out = tmp_path / "out.json"
    check(mpirun(2, [SCRIPT, str(root), "1", "many", str(out)], timeout=90))
    got = json.loads(out.read_text())
    assert got["joules"] is None and got["cpu_j"] is None and got["core_s"] > 0
    assert got["described"].startswith("not measured (RAPL: ")
    assert "node1/intel-rapl:0/energy_uj: No such file" in got["described"]


# ----------------------------------------------------------------------------- analysis
def _write(path: Path, cols, rows) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([r.get(c, "") for c in cols])
    return path


def test_joules_to_target_interpolates_at_the_crossing(tmp_path):
    ev = [{"kind": "eval", "step": s, "heldout_loss": l, "heldout_acc": 0.5,
           "energy_j": j, "core_s": c}
          for s, l, j, c in ((0, 1.0, 0.0, 0.5), (10, 0.8, 100.0, 4.5), (20, 0.4, 300.0, 8.5))]
    tr = [{"kind": "train", "step": 0, "compute_s": 0.1, "comm_s": 0.0, "skipped": 0}]
    d = read_metrics(_write(tmp_path / "metrics.csv", COLUMNS, ev + tr))
    run = Run("semantic", "data", 0, **d)
    # loss 0.6 is crossed halfway from step 10 to 20: 200 J, 6.5 core-seconds
    assert use_to_target(run, 0.6) == pytest.approx(200.0)
    assert use_to_target(run, 0.6, "core_s") == pytest.approx(6.5)
    assert use_to_target(run, 1.0) == 0.0                  # reached at the start
    assert math.isnan(use_to_target(run, 0.1))             # never reached
    ev[1]["energy_j"] = ""                                   # not measured around the crossing
    d = read_metrics(_write(tmp_path / "metrics.csv", COLUMNS, ev + tr))
    run = Run("semantic", "data", 0, **d)
    assert math.isnan(use_to_target(run, 0.6))
    assert use_to_target(run, 0.6, "core_s") == pytest.approx(6.5)


def test_metrics_of_an_older_release_read_as_not_measured(tmp_path):
    old = COLUMNS[:COLUMNS.index("energy_j")]
    rows = [{"kind": "eval", "step": 0, "heldout_loss": 1.0, "heldout_acc": 0.5},
            {"kind": "train", "step": 0, "loss": 1.0, "compute_s": 0.1, "comm_s": 0.0,
             "skipped": 0},
            {"kind": "eval", "step": 1, "heldout_loss": 0.5, "heldout_acc": 0.6}]
    p = _write(tmp_path / "metrics.csv", old, rows)
    d = read_metrics(p)
    assert list(d["steps"]) == [0, 1] and np.isnan(d["energy_j"]).all()
    assert math.isnan(use_to_target(Run("s", "m", 0, **d), 0.7))
    kept = _read_rows(p, 1)                        # a resumed run keeps an older file's rows
    assert [r["kind"] for r in kept] == ["eval", "train", "eval"]
    assert all(r.get("energy_j", "") == "" for r in kept)


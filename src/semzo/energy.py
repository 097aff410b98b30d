"""Energy meters: what a run used, where the machine exposes it, and CPU core-seconds always.

Meters (read once per machine, by one rank, and summed over machines):

* **RAPL** (CPU packages): ``/sys/class/powercap/intel-rapl:N/energy_uj`` of every package
  domain ``intel-rapl:N`` (its sub-domains ``intel-rapl:N:M``, core and uncore, are parts of
  it and not added again). The counter wraps at ``max_energy_range_uj``: a reading lower than
  the previous one adds that range, so a counter must be read at least once per wrap period
  (minutes at full power); :meth:`EnergyMeter.poll` does that between the collective reads.
  Since Linux 5.10 ``energy_uj`` is readable by root only, so on many machines RAPL exists
  but cannot be read: that counts as not measured.
* **NVML** (NVIDIA GPUs, ``nvidia-ml-py``): ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since
  the driver loaded; Volta and newer) of each GPU the machine's ranks are bound to, each GPU
  once however many ranks share it.

A meter counts only when every machine of the run can read it; otherwise it is *not
measured* (a partial sum would be an understatement presented as a measurement), and the
reason is logged once. Nothing is ever estimated. CPU core-seconds (``time.process_time()``,
user + system time of every thread of each rank, summed over ranks) are always recorded.

A *machine* is a real host: the topology's node, except that the nodes of a deck-simulated
hierarchy (``topology.ranks_per_node``, named ``HOST/simN``) on one host share its counters,
so only the first of them reads. The sources are injectable (``powercap``: the sysfs root,
``nvml``: a module with pynvml's functions) for tests; ``SEMZO_TEST_POWERCAP`` points the
finetune stage at a fake powercap tree (tests only).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .runtime import get_logger

log = get_logger(__name__)

POWERCAP = Path("/sys/class/powercap")
_PACKAGE = re.compile(r"intel-rapl:\d+")           # a package domain, not intel-rapl:N:M
_SIM = re.compile(r"/sim\d+$")                       # simulated node names: HOST/simN


def _read_int(path: Path) -> int:
    with open(path, encoding="ascii") as f:
        return int(f.read().strip())


def _why(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


class Rapl:
    """The package energy counters under a powercap root, accumulated across wrap-arounds.

    ``ok``: every package domain was readable when opened (else ``reason`` says why);
    :meth:`poll` returns the joules since opening and raises ``OSError``/``ValueError`` when a
    counter stops being readable."""

    def __init__(self, root: str | Path = POWERCAP) -> None:
        self.root = Path(root)
        self.reason = ""
        self._dom: list[list] = []                   # [energy_uj path, range, last raw]
        self._uj = 0
        try:
            dirs = sorted(p for p in self.root.iterdir() if _PACKAGE.fullmatch(p.name))
        except OSError as exc:
            self.reason = f"{self.root}: {_why(exc)}"
            return
        if not dirs:
            self.reason = f"{self.root}: no RAPL package domain (intel-rapl:N)"
            return
        dom = []
        for d in dirs:
            try:
                dom.append([d / "energy_uj", _read_int(d / "max_energy_range_uj"),
                            _read_int(d / "energy_uj")])
            except (OSError, ValueError) as exc:
                self.reason = f"{d / 'energy_uj'}: {_why(exc)}"
                return
        self._dom = dom

    @property
    def ok(self) -> bool:
        return bool(self._dom)

    @property
    def domains(self) -> int:
        return len(self._dom)

    def poll(self) -> float:
        for d in self._dom:
            raw = _read_int(d[0])
            delta = raw - d[2]
            if delta < 0:                              # the counter wrapped
                delta += d[1]
            self._uj += delta
            d[2] = raw
        return self._uj * 1e-6


class Nvml:
    """The total-energy counters (mJ) of some GPUs through NVML. ``gpus``: PCI bus ids (str)
    or NVML indices (int), each read once. ``nvml``: the module (default: ``import pynvml``).
    ``ok`` / ``reason`` as for :class:`Rapl`."""

    def __init__(self, gpus, nvml=None) -> None:
        self.reason = ""
        self.gpus = list(dict.fromkeys(gpus))
        self._h: list = []
        self._last: list[int] = []
        self._mj = 0
        self._nv = None
        if not self.gpus:
            self.reason = "no GPU bound"
            return
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py, only for GPU runs
            except ImportError:
                self.reason = "nvidia-ml-py is not installed (a runtime dependency: make setup)"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError (no driver), or a library error
            self.reason = f"nvmlInit: {exc}"
            return
        self._nv = nvml
        try:
            for g in self.gpus:
                h = (nvml.nvmlDeviceGetHandleByPciBusId(g) if isinstance(g, str)
                     else nvml.nvmlDeviceGetHandleByIndex(int(g)))
                self._last.append(int(nvml.nvmlDeviceGetTotalEnergyConsumption(h)))
                self._h.append(h)
        except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported (pre-Volta) and kin
            self.reason = f"GPU {g}: nvmlDeviceGetTotalEnergyConsumption: {exc}"
            self._h = []
            self.close()

    @property
    def ok(self) -> bool:
        return bool(self._h)

    def poll(self) -> float:
        for i, h in enumerate(self._h):
            raw = int(self._nv.nvmlDeviceGetTotalEnergyConsumption(h))
            delta = raw - self._last[i]
            if delta < 0:                              # a 64-bit counter: wrapped
                delta += 1 << 64
            self._mj += delta
            self._last[i] = raw
        return self._mj * 1e-3

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:  # noqa: BLE001, S110 - shutting down: nothing left to do
                pass
            self._nv = None


@dataclass(frozen=True)
class Reading:
    """The run's use so far, summed over machines and ranks (the same on every rank).
    ``cpu_j`` / ``gpu_j``: None when that meter is not measured; ``joules``: their sum over
    the measured ones, None when neither is."""

    cpu_j: float | None
    gpu_j: float | None
    core_s: float

    @property
    def joules(self) -> float | None:
        got = [x for x in (self.cpu_j, self.gpu_j) if x is not None]
        return sum(got) if got else None

    def row(self) -> dict:
        """The metrics.csv cells (:mod:`semzo.finetune.report`)."""
        return {"energy_j": self.joules, "cpu_energy_j": self.cpu_j,
                "gpu_energy_j": self.gpu_j, "core_s": self.core_s}


def host_of(node_name: str) -> str:
    """The real host of a topology node name (a simulated node ``HOST/simN`` -> ``HOST``)."""
    return _SIM.sub("", node_name)


class EnergyMeter:
    """A run's energy meters. Built by every rank (collective over ``topo.world``): the first
    rank of each host opens the meters (RAPL always; NVML when ``gpu`` is given, this rank's
    GPU as a PCI bus id or NVML index), and the ranks agree on which meters count.

    :meth:`read` is collective; :meth:`poll` is local (readers only; cheap, throttled to
    ``poll_s``) and keeps wrapping counters honest between reads. ``offset``: a reading to
    continue from (a resumed run)."""

    def __init__(self, topo, *, gpu=None, powercap: str | Path = POWERCAP, nvml=None,
                 poll_s: float = 1.0, gpu_run: bool | None = None) -> None:
        self.topo = topo
        self.poll_s = poll_s
        hosts = [host_of(topo.node_names[int(n)]) for n in topo.rank_node]
        me = hosts[topo.rank]
        self.reader = topo.rank == hosts.index(me)
        self.n_hosts = len(set(hosts))
        gpus = topo.world.allgather(gpu)
        self.gpu_run = any(g is not None for g in gpus) if gpu_run is None else gpu_run
        self.rapl = self.nvml = None
        reasons = ["", ""]
        if self.reader:
            self.rapl = Rapl(powercap)
            reasons[0] = self.rapl.reason
            if self.gpu_run:
                mine = [g for g, h in zip(gpus, hosts) if h == me and g is not None]
                self.nvml = Nvml(mine, nvml)
                reasons[1] = self.nvml.reason
        ok = np.array([int(self.reader), int(bool(self.rapl and self.rapl.ok)),
                       int(bool(self.nvml and self.nvml.ok))], np.int64)
        topo.allreduce(ok)
        self.cpu = int(ok[1]) == int(ok[0])
        self.gpu = self.gpu_run and int(ok[2]) == int(ok[0])
        said = topo.world.allgather(reasons if self.reader else None)
        self._why = {"RAPL": _first([s[0] for s in said if s]),
                     "NVML": _first([s[1] for s in said if s]) if self.gpu_run
                     else "not a GPU run"}
        self._bad = np.zeros(2, np.int64)              # a meter that failed after opening
        self._cpu_j = self._gpu_j = 0.0
        self._last = time.perf_counter()
        self._core0 = time.process_time()
        self.offset: Reading | None = None
        self.closed = False
        if topo.rank == 0:
            log.info("energy: %s", self.describe())

    def describe(self) -> str:
        """What is measured, or why not (the same text on every rank)."""
        hosts = f"{self.n_hosts} host{'s' if self.n_hosts > 1 else ''}"
        got = []
        if self.cpu:
            got.append(f"CPU packages by RAPL on {hosts}")
        if self.gpu:
            got.append(f"GPUs by NVML on {hosts}")
        miss = [f"{k}: {v}" for k, v in self._why.items()
                if not (self.cpu if k == "RAPL" else self.gpu)]
        if not got:
            return (f"not measured ({'; '.join(miss)}); CPU core-seconds are recorded "
                    f"instead")
        return "measured: " + ", ".join(got) + (f" (not measured: {'; '.join(miss)})"
                                                if miss else "")

    def poll(self, force: bool = False) -> None:
        """Read this host's counters (readers; others: nothing). Local, no MPI."""
        if not self.reader:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.poll_s:
            return
        self._last = now
        for i, (meter, used) in enumerate(((self.rapl, self.cpu), (self.nvml, self.gpu))):
            if used and meter is not None and not self._bad[i]:
                try:
                    j = meter.poll()
                except Exception as exc:  # noqa: BLE001 - a file gone, an NVML error
                    self._bad[i] = 1
                    log.warning("energy: %s stopped being readable on rank %d (%s): not "
                                "measured from here on", "RAPL" if i == 0 else "NVML",
                                self.topo.rank, _why(exc))
                    continue
                if i == 0:
                    self._cpu_j = j
                else:
                    self._gpu_j = j

    def read(self) -> Reading:
        """The use so far, summed over hosts and ranks. Collective over ``topo.world``."""
        self.poll(force=True)
        buf = np.array([self._cpu_j if self.reader else 0.0,
                        self._gpu_j if self.reader else 0.0,
                        time.process_time() - self._core0, *self._bad], np.float64)
        self.topo.allreduce(buf)
        if buf[3]:
            self.cpu = False
        if buf[4]:
            self.gpu = False
        off = self.offset
        cpu = float(buf[0]) if self.cpu else None
        gpu = float(buf[1]) if self.gpu else None
        core = float(buf[2])
        if off is not None:                            # a resumed run continues the counts
            cpu = None if cpu is None or off.cpu_j is None else cpu + off.cpu_j
            gpu = None if gpu is None or off.gpu_j is None else gpu + off.gpu_j
            core += off.core_s
        return Reading(cpu, gpu, core)

    def close(self) -> None:
        if self.nvml is not None and not self.closed:
            self.nvml.close()
        self.closed = True


def _first(reasons: list[str]) -> str:
    """The first non-empty reason, with how many hosts gave one."""
    bad = [r for r in reasons if r]
    if not bad:
        return ""
    more = f" (and {len(bad) - 1} more host{'s' if len(bad) > 2 else ''})" if len(bad) > 1 \
        else ""
    return bad[0] + more


def summary(reading: Reading, meter: EnergyMeter) -> dict:
    """The run summary's energy entries: joules (and what they cover), or "not measured"
    with the CPU core-seconds that are recorded instead."""
    if reading.joules is None:
        return {"energy": "not measured (no readable RAPL/NVML)",
                "CPU core-seconds": reading.core_s}
    out = {"energy J": reading.joules}
    if reading.cpu_j is not None and reading.gpu_j is not None:
        out.update({"CPU energy J": reading.cpu_j, "GPU energy J": reading.gpu_j})
    elif meter.gpu_run:
        out["energy covers"] = ("CPU packages only (GPUs not measured)" if reading.gpu_j is None
                                else "GPUs only (CPU packages not measured)")
    out["CPU core-seconds"] = reading.core_s
    return out


def powercap_root() -> str | Path:
    """``SEMZO_TEST_POWERCAP`` (tests: a fake powercap tree) or the real sysfs root."""
    return os.environ.get("SEMZO_TEST_POWERCAP") or POWERCAP

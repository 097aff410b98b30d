"""Two cluster nodes on one Linux machine, for Open MPI: two network namespaces, each with its
own host name and address on a private bridge, and ``mpirun`` launching its daemons into them
through a remote-shell agent (tests/netns_rsh.sh) instead of ssh.

What MPI then sees is what it sees on two real nodes: two daemons (Open MPI 4: ``orted``,
Open MPI 5: ``prted``), so ``MPI_COMM_TYPE_SHARED`` splits the ranks by namespace; the ranks
talk over TCP only (``--mca btl tcp,self``: no shared memory between ranks, not even on one
"node"); the launcher reaches the daemons over the bridge. Only the file system is shared, as
a cluster's parallel file system is.

Layout (``SEMZO_MULTINODE_NET``, default ``10.213.7``, names its /24)::

    root namespace: bridge szbr0 10.213.7.1/24, launcher (mpirun)
      veth szv1 <-> eth0 in namespace semzo-node1, 10.213.7.11, host name node1
      veth szv2 <-> eth0 in namespace semzo-node2, 10.213.7.12, host name node2

Needs root, iproute2 (``ip``) and util-linux (``unshare``). :func:`why_not` says why the
machine cannot, for a skip. :func:`two_nodes` creates everything and removes it again (the
processes left in the namespaces first), also when the body fails; a lock file keeps two
test sessions on one machine from using the same names at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENT = HERE / "netns_rsh.sh"
NET = os.environ.get("SEMZO_MULTINODE_NET", "10.213.7")
BRIDGE = "szbr0"
LOCK = Path("/run/lock/semzo-multinode.lock")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False,
                          timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def ompi_major() -> int | None:
    """Open MPI's major version from ``mpirun --version``; None for another MPI."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Open MPI\)? (\d+)\.", out)
    return int(m.group(1)) if m else None


def why_not() -> str | None:
    """Why this machine cannot run the two-namespace test, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and a bridge need root"
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux"), ("mpirun", "openmpi-bin")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package {pkg})"
    if ompi_major() not in (4, 5):
        return "the harness drives Open MPI 4 or 5 (mpirun --version says otherwise)"
    probe = f"semzo-probe-{os.getpid()}"
    proc = _ip("netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Nodes:
    """Two namespaces playing two nodes; ``hosts[i]`` is node i's address."""

    namespaces: list[str]
    names: list[str]
    hosts: list[str]
    subnet: str
    launcher: str                     # the bridge's address: where the daemons call back
    env: dict[str, str] = field(default_factory=dict)

    def mpirun(self, per_node: int, args: list[str], *, timeout: float) -> list[str]:
        """The command line that starts ``python args...`` with ``per_node`` ranks on each
        node (ranks 0..per_node-1 on node 1), under coreutils ``timeout``."""
        hosts = ",".join(f"{h}:{per_node}" for h in self.hosts)
        cmd = ["timeout", "-k", "5", str(int(timeout)), "mpirun",
               "-n", str(per_node * len(self.hosts)), "--host", hosts, "--map-by", "slot",
               "--bind-to", "none",
               "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.subnet]
        if ompi_major() == 5:   # PRRTE launches prted; its options go through --prtemca
            cmd += ["--prtemca", "plm_ssh_agent", str(AGENT),
                    "--prtemca", "plm_ssh_no_tree_spawn", "1",
                    "--prtemca", "oob_tcp_if_include", self.subnet]
        else:                   # ORTE: orted, the rsh launcher's agent
            cmd += ["--mca", "plm_rsh_agent", str(AGENT),
                    "--mca", "plm_rsh_no_tree_spawn", "1",
                    "--mca", "oob_tcp_if_include", self.subnet]
        return [*cmd, sys.executable, *args]

    def pids(self) -> list[int]:
        """Every process inside the two namespaces (daemons and ranks)."""
        out = []
        for ns in self.namespaces:
            out += [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        return out


def _teardown(namespaces: list[str], veths: list[str]) -> list[str]:
    """Kill what runs in the namespaces, delete veths, bridge and namespaces; errors as text."""
    errors = []
    for ns in namespaces:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists()]
            time.sleep(0.05)
    for link in [*veths, BRIDGE]:
        if _ip("link", "show", link, check=False).returncode == 0:
            proc = _ip("link", "del", link, check=False)
            if proc.returncode != 0:
                errors.append(f"ip link del {link}: {proc.stderr.strip()}")
    for ns in namespaces:
        if _ip("netns", "pids", ns, check=False).returncode == 0 or \
                Path(f"/run/netns/{ns}").exists():
            proc = _ip("netns", "del", ns, check=False)
            if proc.returncode != 0:
                errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
    return errors


@contextlib.contextmanager
def two_nodes(net: str = NET) -> Iterator[Nodes]:
    """Create the bridge, two namespaces and their veth pairs; yield :class:`Nodes`; remove
    all of it afterwards, whatever happened."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # one user of these names at a time
        namespaces = ["semzo-node1", "semzo-node2"]
        veths = ["szv1", "szv2"]
        _teardown(namespaces, veths)           # what a killed earlier session left
        try:
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{net}.1/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
            hosts = []
            for i, (ns, veth) in enumerate(zip(namespaces, veths, strict=True), start=1):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", BRIDGE)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "addr", "add", f"{net}.{10 + i}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                hosts.append(f"{net}.{10 + i}")
            names = ["node1", "node2"]
            nodes = Nodes(namespaces=namespaces, names=names, hosts=hosts,
                          subnet=f"{net}.0/24", launcher=f"{net}.1")
            nodes.env = {"SEMZO_NETNS_HOSTS": " ".join(
                f"{h}={ns}={n}" for h, ns, n in zip(hosts, namespaces, names, strict=True))}
            yield nodes
        finally:
            errors = _teardown(namespaces, veths)
            if errors:
                raise RuntimeError("multinode teardown: " + "; ".join(errors))


def rank_pid(rank: int, marker: str) -> int | None:
    """The pid of MPI rank ``rank`` of the launch whose environment holds ``marker``
    (``SEMZO_MULTINODE_RUN=<marker>``), found in /proc (the namespaces share the pid space)."""
    want = {b"SEMZO_MULTINODE_RUN=" + marker.encode(), b"OMPI_COMM_WORLD_RANK=%d" % rank}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            return int(d.name)
    return None

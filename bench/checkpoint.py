"""Checkpoint benchmark: semzo's collective HDF5 checkpoint against the disk and the peers.

    mpirun -n 4 python bench/checkpoint.py [--gib 1.0] [--dir DIR] [--repeat 2]

Measured in one run, on the same parameter set (a transformer-like mix of >= 1 GiB of float32
tensors, large matrices and many small vectors, replicated on every rank):

- plain MPI-IO: every rank writes its contiguous 1/P of the same bytes with one
  ``Write_at``, then ``MPI_File_sync`` (the best a parallel writer of these bytes can do);
- the disk: ``dd`` sequential write (``conv=fdatasync``) and read (``iflag=direct``, after
  dropping the page cache when allowed) of a file of the same size, from one process; every
  read row (dd's and semzo's alike) starts cold: the page cache is dropped before it;
- semzo: ``Checkpointer.save`` with each ``transfer`` mode (mpio file, 1/P of every tensor
  per rank, XXH64 of every block, flush to the device, atomic rename, ``latest``),
  ``verify`` (each rank reads and checks its 1/P) and ``load`` (verified, every rank ends
  with every parameter: ``distribute`` = read and allgather), the page cache dropped before
  every read;
- peers: ``numpy.save`` of each rank's share into a file per rank (+ fsync), and
  ``torch.save`` of the whole state dict on rank 0 (+ fsync), the usual data-parallel way,
  with their loads;
- training time lost per checkpoint: a simulated training loop (numpy work + one scalar
  allreduce per step) with no checkpoint, a synchronous one, and an asynchronous one (the
  background write must finish before the loop ends: ``close`` is counted), once per round
  with the order of the three rotated; the medians and the per-round difference async -
  sync are printed (one sample of a cost of about 2 s is noise on a shared machine).

Prints a table: seconds (max over ranks), GiB/s, and the ratio to the dd figure (the median
of the rounds; dd's own spread over the rounds and the per-round ratio of semzo's save are
printed below the table), with ``uptime`` before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from semzo.backend import cpu_model
from semzo.checkpoint import Checkpointer, load, verify
from semzo.checkpoint.format import BlockLayout, rank_rows
from semzo.deck import CheckpointSection
from semzo.runtime import setup_logging

GIB = 2**30
TRANSFERS = ("independent", "individual", "collective")
W_DD, R_DD = "dd write (conv=fdatasync), 1 process", "dd read (iflag=direct), 1 process"
W_NP, R_NP = "numpy.save, a file per rank, + fsync", "numpy.load, a file per rank"
W_TORCH, R_TORCH = "torch.save on rank 0, + fsync", "torch.load on rank 0"
W_MPIIO = "plain MPI-IO Write_at, 1/P each, + sync"
R_VERIFY = "semzo verify (each rank 1/P: read + xxh64)"
R_LOAD = "semzo load, distribute=read (auto, 1 node)"
R_GATHER = "semzo load, distribute=allgather"
WRITES = (W_DD, W_MPIIO, *TRANSFERS, W_NP, W_TORCH)
ROWS = (*WRITES, R_DD, R_VERIFY, R_LOAD, R_GATHER, R_NP, R_TORCH)


def parameter_set(gib: float) -> dict[str, np.ndarray]:
    """A BERT-large-like set: embeddings, then layers of 4 matrices and 8 vectors, until the
    total reaches ``gib`` GiB. Contents are cheap to make and differ per tensor."""
    h, ff, vocab = 1024, 4096, 30522
    out: dict[str, np.ndarray] = {}

    def add(name, shape):
        a = np.empty(shape, dtype=np.float32)
        a.reshape(-1)[:] = np.float32(len(out) + 1)
        a.reshape(-1)[:: 997] = np.arange(a.size // 997 + (a.size % 997 > 0), dtype=np.float32)
        out[name] = a

    add("embeddings.word_embeddings.weight", (vocab, h))
    add("embeddings.position_embeddings.weight", (512, h))
    add("embeddings.LayerNorm.weight", (h,))
    add("embeddings.LayerNorm.bias", (h,))
    layer = 0
    while sum(a.nbytes for a in out.values()) < gib * GIB:
        p = f"encoder.layer.{layer}."
        for name, shape in (("attention.self.qkv.weight", (3 * h, h)), ("attention.self.qkv.bias",
                            (3 * h,)), ("attention.output.dense.weight", (h, h)),
                            ("attention.output.dense.bias", (h,)),
                            ("attention.output.LayerNorm.weight", (h,)),
                            ("attention.output.LayerNorm.bias", (h,)),
                            ("intermediate.dense.weight", (ff, h)),
                            ("intermediate.dense.bias", (ff,)), ("output.dense.weight", (h, ff)),
                            ("output.dense.bias", (h,)), ("output.LayerNorm.weight", (h,)),
                            ("output.LayerNorm.bias", (h,))):
            add(p + name, shape)
        layer += 1
    return out


def drop_caches(comm) -> str:
    """Flush and drop the page cache (rank 0, needs root); returns 'dropped' or why not."""
    msg = None
    if comm.Get_rank() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
            msg = "dropped"
        except OSError as exc:
            msg = f"not allowed ({exc.strerror})"
    msg = comm.bcast(msg, root=0)
    comm.Barrier()
    return msg


def _uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True,
                          text=True).stdout.strip()


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX), out


def dd(path: Path, nbytes: int, comm) -> tuple[float, float, str]:
    """(write s, read s, cache note) of a dd of ``nbytes`` on rank 0; others wait."""
    res = None
    if comm.Get_rank() == 0:
        bs = 16 << 20
        count = -(-nbytes // bs)
        w = subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                            "conv=fdatasync"], capture_output=True, text=True, check=True)
        res = [_dd_seconds(w.stderr)]
    drop = drop_caches(comm)
    if comm.Get_rank() == 0:
        r = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={16 << 20}",
                            "iflag=direct"], check=False, capture_output=True, text=True)
        if r.returncode != 0:   # O_DIRECT not supported here: cached read after the drop
            r = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={16 << 20}"],
                               capture_output=True, text=True, check=True)
            drop += ", no O_DIRECT"
        res.append(_dd_seconds(r.stderr))
        path.unlink()
        res[0] *= nbytes / (count * bs)      # scale to the parameter bytes
        res[1] *= nbytes / (count * bs)
    res = comm.bcast(res, root=0)
    return res[0], res[1], drop


def _dd_seconds(text: str) -> float:
    return float(re.search(r"copied, ([0-9.]+) s", text).group(1))


def my_slabs(params, comm, block_bytes):
    """This rank's rows of every tensor, in semzo's block split (the same share per rank)."""
    out, shift = [], 0
    for a in params.values():
        lay = BlockLayout.of(a.shape, a.itemsize, block_bytes)
        lo, hi, _, _ = rank_rows(lay, comm.Get_rank(), comm.Get_size(), shift)
        shift += lay.n_blocks
        out.append(a[lo:hi])
    return out


def mpiio_slab(params, comm) -> tuple[int, np.ndarray]:
    """(byte offset, bytes) of this rank's contiguous 1/P of all parameter bytes, whole
    MiB (built before timing: the reference is the write alone)."""
    total = sum(a.nbytes for a in params.values())
    mib = -(-total // (1 << 20))
    r, p = comm.Get_rank(), comm.Get_size()
    lo, hi = min(total, (mib * r // p) << 20), min(total, (mib * (r + 1) // p) << 20)
    out, pos = np.empty(hi - lo, np.uint8), 0
    for a in params.values():
        b = a.reshape(-1).view(np.uint8)
        s, e = max(lo, pos), min(hi, pos + b.size)
        if s < e:
            out[s - lo:e - lo] = b[s - pos:e - pos]
        pos += b.size
    return lo, out


def mpiio_write(path: Path, slab: tuple[int, np.ndarray], comm) -> float:
    """Plain MPI-IO: every rank writes its slab with one independent Write_at, then
    MPI_File_sync (as semzo's flush) and close."""
    def write():
        fh = MPI.File.Open(comm, str(path), MPI.MODE_WRONLY | MPI.MODE_CREATE)
        fh.Write_at(slab[0], slab[1])
        fh.Sync()
        fh.Close()

    dt, _ = timed(comm, write)
    if comm.Get_rank() == 0:
        path.unlink()
    return dt


def numpy_save(d: Path, slabs, comm) -> tuple[float, float]:
    f = d / f"np-rank{comm.Get_rank()}.npy"

    def write():
        with open(f, "wb") as fh:
            for s in slabs:
                np.save(fh, s)
            fh.flush()
            os.fsync(fh.fileno())

    tw, _ = timed(comm, write)
    drop_caches(comm)

    def read():
        with open(f, "rb") as fh:
            return [np.load(fh) for _ in slabs]

    tr, got = timed(comm, read)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], slabs[:3]))
    f.unlink()
    return tw, tr


def torch_save(d: Path, params, comm) -> tuple[float, float]:
    import torch

    f = d / "torch.pt"

    def write():
        if comm.Get_rank() == 0:
            with open(f, "wb") as fh:
                torch.save({k: torch.from_numpy(v) for k, v in params.items()}, fh)
                fh.flush()
                os.fsync(fh.fileno())

    tw, _ = timed(comm, write)
    drop_caches(comm)

    def read():
        if comm.Get_rank() == 0:
            return torch.load(f, weights_only=True)
        return None

    tr, _ = timed(comm, read)
    if comm.Get_rank() == 0:
        f.unlink()
    return tw, tr


def training_loss(ck_mode: str, params, d: Path, comm, steps: int, at: int):
    """Training seconds lost to one checkpoint saved at step ``at`` of a simulated loop.

    The reference step time is the median of the steps before the checkpoint in the same run
    (the machine is shared, so runs drift); lost = sum over later steps of (step - reference)
    plus the final ``close`` (which waits for a background write). Max over ranks.
    """
    x = np.random.default_rng(comm.Get_rank()).standard_normal((192, 192))
    ck = None
    if ck_mode != "none":
        ck = Checkpointer(comm, CheckpointSection(dir=str(d / ck_mode), keep=1,
                                                  async_save=ck_mode == "async"))
    times, blocked = [], 0.0
    comm.Barrier()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        for _ in range(6):                              # the forward passes
            x = np.tanh(x @ x.T * 1e-3)
        g = np.array([float(x[0, 0])])
        comm.Allreduce(MPI.IN_PLACE, g)                 # the projected gradient
        params["embeddings.LayerNorm.bias"][0] += 1e-6  # the update touches the params
        if ck is not None and step == at:
            tb = time.perf_counter()
            ck.save(step, params, {"step": step})
            blocked += time.perf_counter() - tb
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    how = ""
    if ck is not None:
        how = "background" if ck.background else "synchronous"
        ck.close()
    t_close = time.perf_counter() - t0
    ref = float(np.median(times[:at - 1]))
    lost = sum(t - ref for t in times[at - 1:]) + t_close
    if ck is not None and comm.Get_rank() == 0:
        shutil.rmtree(d / ck_mode)
    return (comm.allreduce(lost, op=MPI.MAX), comm.allreduce(ref, op=MPI.MAX),
            comm.allreduce(blocked + t_close, op=MPI.MAX), how)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: a "
                    "temporary folder under /tmp)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    setup_logging("WARNING")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    base = None
    if rank == 0:
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores", flush=True)
        print("before:", _uptime(), flush=True)
        base = tempfile.mkdtemp(prefix="semzo-bench-ckpt-", dir=args.dir or "/tmp")
        print(subprocess.run(["df", "-h", "/tmp", "/work", base], check=False, capture_output=True,
                             text=True).stdout, flush=True)
    d = Path(comm.bcast(base, root=0))
    params = parameter_set(args.gib)
    nbytes = sum(a.nbytes for a in params.values())
    if rank == 0 and shutil.disk_usage(d).free < 3 * nbytes:
        print(f"not enough space in {d} for {3 * nbytes / GIB:.1f} GiB", file=sys.stderr)
        comm.Abort(2)
    slab = mpiio_slab(params, comm)
    t: dict[str, list[float]] = {}      # label -> seconds per round
    cache = ""
    try:
        for _ in range(args.repeat):      # rounds: the machine is shared and drifts, so every
            dd_w, dd_r, cache = dd(d / "dd.bin", nbytes, comm)      # figure is taken in each
            t.setdefault(W_DD, []).append(dd_w)
            t.setdefault(R_DD, []).append(dd_r)
            t.setdefault(W_MPIIO, []).append(mpiio_write(d / "mpiio.bin", slab, comm))
            for mode in TRANSFERS:
                cfg = CheckpointSection(dir=str(d / "ck"), keep=1, transfer=mode)
                ck = Checkpointer(comm, cfg)
                step = len(t.get(mode, [])) + 1
                dt, path = timed(comm, lambda ck=ck, step=step: ck.save(step, params,
                                                                        {"step": step}))
                ck.close()
                t.setdefault(mode, []).append(dt)
            drop_caches(comm)
            dt, (ok, why) = timed(comm, lambda path=path: verify(path, comm))
            assert ok, why
            t.setdefault(R_VERIFY, []).append(dt)
            for label, how in ((R_LOAD, "read"), (R_GATHER, "allgather")):
                drop_caches(comm)
                dt, loaded = timed(comm, lambda path=path, how=how: load(path, comm,
                                                                         distribute=how))
                assert all(np.array_equal(loaded.params[k], params[k])
                           for k in list(params)[:5])
                del loaded
                t.setdefault(label, []).append(dt)
            slabs = my_slabs(params, comm, cfg.block_kib * 1024)
            nw, nr = numpy_save(d, slabs, comm)
            pw, pr = torch_save(d, params, comm)
            for k, v in ((W_NP, nw), (R_NP, nr), (W_TORCH, pw), (R_TORCH, pr)):
                t.setdefault(k, []).append(v)
        steps, at = args.steps, args.steps // 4
        lost: dict[str, list[tuple]] = {"none": [], "sync": [], "async": []}
        for r in range(args.repeat):    # rounds, the order rotated: one sample of a ~2 s
            order = ("none", "sync", "async")           # cost on a shared machine is noise
            for mode in order[r % 3:] + order[:r % 3]:
                lost[mode].append(training_loss(mode, params, d, comm, steps, at))
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    if rank == 0:
        io = os.environ.get("OMPI_MCA_io", "ompio (Open MPI default)")
        print(f"checkpoint benchmark: {nbytes / GIB:.2f} GiB in {len(params)} float32 tensors, "
              f"{size} ranks, MPI-IO {io}, page cache before reads: {cache}; "
              f"{args.repeat} rounds, median (min) seconds, max over ranks")
        print(f"{'':<44}{'median s':>9}{'min s':>7}{'max s':>7}{'GiB/s':>7}{'vs dd':>7}")
        for label in ROWS:
            v = np.array(t[label])
            base = np.median(t[W_DD if label in WRITES else R_DD])
            name = {"independent": "semzo save, transfer=independent (default)",
                    "individual": "semzo save, transfer=individual",
                    "collective": "semzo save, transfer=collective"}.get(label, label)
            med = float(np.median(v))
            print(f"{name:<44}{med:>9.2f}{v.min():>7.2f}{v.max():>7.2f}"
                  f"{nbytes / GIB / med:>7.2f}{base / med:>7.0%}")
        v = np.array(t[W_DD])
        print(f"dd write spread over {v.size} rounds: min {v.min():.2f} s, median "
              f"{np.median(v):.2f} s, max {v.max():.2f} s ({nbytes / GIB / v.max():.2f} to "
              f"{nbytes / GIB / v.min():.2f} GiB/s); semzo save (default) over dd, per round: "
              + ", ".join(f"{a / b:.0%}" for a, b in zip(t[W_DD], t["independent"])))
        print("after:", _uptime())
        med = {m: float(np.median([v[0] for v in lost[m]])) for m in lost}
        blk = {m: float(np.median([v[2] for v in lost[m]])) for m in lost}
        ref = float(np.median([v[1] for v in lost["none"]]))
        how = sorted({v[3] for v in lost["async"]})
        diff = [a[0] - b[0] for a, b in zip(lost["async"], lost["sync"])]
        print(f"\ntraining time lost per checkpoint ({steps} simulated steps of about "
              f"{ref * 1e3:.0f} ms, checkpoint at step {at}; max over ranks; {args.repeat} "
              "rounds, the order of the three rotated, median):")
        print(f"  {'':<28}{'lost [s]':>9}{'blocked in save+close [s]':>27}  per round [s]")
        for m, name in (("none", "no checkpoint (noise floor)"), ("sync", "synchronous"),
                        ("async", "async_save = true")):
            b = f"{blk[m]:>27.2f}" if m != "none" else " " * 27
            print(f"  {name:<28}{med[m]:>9.2f}{b}  "
                  + " ".join(f"{v[0]:.2f}" for v in lost[m]))
        print(f"  async_save chose at the first save: {' / '.join(how)} ({os.cpu_count()} cores, "
              f"{size} ranks); async - sync, paired by round: "
              + " ".join(f"{x:+.2f}" for x in diff) + f" s, median {np.median(diff):+.2f} s "
              "(goal <= 0)")
        if how == ["synchronous"]:
            print("  (async_save = true saved synchronously here, as the synchronous row does: "
                  "the two rows run the same code, so their difference is the host's noise; "
                  "the noise floor row shows its size)")
        print("  lost = sum over steps from the checkpoint on of (step time - median step time "
              "before it) + close; blocked = time inside save() and close()")


if __name__ == "__main__":
    main()

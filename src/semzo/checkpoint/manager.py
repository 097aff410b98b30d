"""The checkpoint folder: when to save, the ``latest`` pointer, keeping the last K, resuming.

Folder layout: ``ckpt-<step 9 digits>.h5`` (complete files only: they appear by rename),
``ckpt-....h5.tmp`` (a write in progress, or left by a killed job), and ``latest`` (one line:
the file name of the newest complete checkpoint, replaced atomically after the file is
complete). :func:`find_resumable` does not trust names alone: it verifies every candidate,
newest step first (the whole file on rank 0 before HDF5 opens it, then every block), and
skips incomplete or damaged ones with one warning each.

The training loop's use::

    ck = Checkpointer(topo, deck.checkpoint, deck.run.output_dir, deck.to_toml(),
                      shards_path=ctx.path("shards.h5"))
    loaded = ck.resume(shard_size=n_local)        # None: no valid checkpoint, or "never"
    for step in range(start, steps):
        ...
        ck.maybe_save(step + 1, params, state.to_dict(), {"cursor": cur, "shard_size": n},
                      {"centroids": c}, {"loss": loss})
    ck.save(steps, ...)          # the final one (no-op if maybe_save just wrote this step)
    ck.close()
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

from mpi4py import MPI

from ..deck import CheckpointSection, DeckError
from ..runtime import AllRanksError, SemzoError, get_logger
from . import format as fmt
from .format import CheckpointError, manifest_checksum
from .reader import Loaded, load, verify
from .writer import WriteOptions, fsync_dir, prepare, write_file

log = get_logger(__name__)

LATEST = "latest"
BEST = "best.h5"               # the best held-out model (Checkpointer.save_best)
_THREAD_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                  "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                  MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


class CheckpointDirError(SemzoError):
    """The checkpoint folder cannot be written (or is full); raised on every rank, exit 2."""

    all_ranks = True


# --------------------------------------------------------------------------- the folder
def list_checkpoints(d: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete-by-name checkpoints in ``d``, oldest first."""
    d = Path(d)
    if not d.is_dir():
        return []
    out = [(s, d / n) for n in os.listdir(d) if (s := fmt.step_of(n)) is not None]
    return sorted(out)


def read_latest(d: str | Path) -> str | None:
    """The file name the ``latest`` pointer holds, or None."""
    try:
        name = (Path(d) / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name if fmt.step_of(name) is not None else None


def write_latest(d: str | Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (temporary file, fsync, rename, fsync dir)."""
    d = Path(d)
    tmp = d / (LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, d / LATEST)
    fsync_dir(d)


def prune(d: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names)."""
    ckpts = list_checkpoints(d)
    latest = read_latest(d)
    gone = []
    for _, p in ckpts[:max(0, len(ckpts) - keep)]:
        if p.name != latest:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def _agree_error(comm: MPI.Intracomm, err: str | None) -> None:
    err = comm.bcast(err, root=0)
    if err:
        raise CheckpointDirError(err)


def prepare_dir(d: Path, comm: MPI.Intracomm) -> None:
    """Create ``d`` and check it is writable (rank 0); raise the same
    :class:`CheckpointDirError` on every rank otherwise. Collective."""
    err = None
    if comm.Get_rank() == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / f".semzo-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            err = f"checkpoint dir {d}: cannot write: {exc.strerror or exc}"
    _agree_error(comm, err)


def check_space(d: Path, need: int) -> str | None:
    """An error text when ``d`` has less free space than ``need`` bytes plus a margin."""
    free = shutil.disk_usage(d).free
    want = int(need * 1.02) + (1 << 20)      # metadata and alignment padding
    if free < want:
        return (f"checkpoint dir {d}: not enough free space: a checkpoint needs about "
                f"{want / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free")
    return None


def topology_info(topo_or_comm) -> dict[str, Any]:
    """What the checkpoint records about the world (a JSON-able dict)."""
    t = topo_or_comm
    if hasattr(t, "rank_node"):
        return {"world_size": t.size, "n_nodes": t.n_nodes, "n_switches": t.n_switches,
                "rank_node": [int(x) for x in t.rank_node],
                "node_switch": [int(x) for x in t.node_switch],
                "node_names": list(t.node_names), "node_source": t.node_source,
                "switch_source": t.switch_source}
    return {"world_size": t.Get_size()}


# --------------------------------------------------------------------------- saving
ASYNC_ENV = "SEMZO_CHECKPOINT_ASYNC"    # "always" / "never": override the decision (tests)


def compute_threads() -> int:
    """Threads this rank's own computation may keep busy: numba's thread count, or the
    BLAS/OpenMP limit when one is set (the larger)."""
    n = 1
    nb = sys.modules.get("numba")
    if nb is not None:
        try:
            n = max(n, int(nb.get_num_threads()))
        except Exception as exc:  # noqa: BLE001 - numba without a threading layer
            log.debug("numba.get_num_threads: %s; counting one thread", exc)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        v = os.environ.get(var, "")
        if v.isdigit():
            n = max(n, int(v))
    return n


def choose_async(cores: int, ranks_on_node: int, threads_per_rank: int,
                 override: str = "", load: float = 0.0) -> tuple[bool, str]:
    """Whether an ``async_save`` run writes in the background, and why (one log line).

    A background write hides its cost only on a core nothing else uses: the writer thread
    copies data into the page cache, hashes the metadata and waits on collective calls.
    When every core is taken it competes with the training for the same cores and costs
    more training time than writing synchronously (measured on 2 cores, 4 ranks: 2.22 s
    lost asynchronously against 0.64 s synchronously; on the same 2 cores shared with other
    people's jobs, 1 rank of 1 thread: 9.7 s against 6.1 s), so the save is synchronous.
    Busy cores: this node's ranks x compute threads, or the node's measured load (the
    1-minute load average at the first save, which counts these ranks and everyone else's
    work), the larger. ``override``: ``always`` or ``never`` (the ``SEMZO_CHECKPOINT_ASYNC``
    environment variable)."""
    own = ranks_on_node * threads_per_rank
    busy = max(own, math.ceil(load - 0.5))      # a load under x.5 rounds down
    free = cores - busy
    what = (f"{cores} cores for {ranks_on_node} ranks x {threads_per_rank} compute "
            f"threads on this node, load average {load:.1f}")
    if override in ("always", "never"):
        return override == "always", f"{ASYNC_ENV}={override} ({what})"
    if free >= 1:
        return True, f"{what}: {free} free, so the write goes on in the background"
    why = "no free core" if busy == own else "no free core (other work keeps them busy)"
    return False, (f"{what}: {why}, so saves are synchronous (a background writer "
                   f"would slow every training step more than a synchronous write costs)")


def _node_cores(comm: MPI.Intracomm) -> tuple[int, int, int, float]:
    """(cores the ranks of this node may run on, ranks on this node, max compute threads
    of a rank, the node's 1-minute load average). Collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else list(range(os.cpu_count() or 1))
        cpus = set().union(*map(set, node.allgather(mine)))
        threads = node.allreduce(compute_threads(), op=MPI.MAX)
        try:
            load = os.getloadavg()[0]
        except OSError:                      # not available: count only our own ranks
            load = 0.0
        load = node.allreduce(load, op=MPI.MAX)
        return len(cpus), node.Get_size(), threads, load
    finally:
        node.Free()


class Checkpointer:
    """Periodic, atomic, verified checkpoints of one run. Built collectively over the world.

    ``comm``: a :class:`~semzo.topology.Topology` (its ``world`` is used and its hierarchy
    recorded) or an intracommunicator. ``cfg``: the deck's ``[checkpoint]`` section;
    ``outdir``: ``run.output_dir`` (the folder defaults to ``outdir/checkpoints``);
    ``deck_toml``: the resolved deck stored in every file; ``shards_path``: the ``shards.h5``
    the run trains on (its path and manifest checksum are recorded); ``model_meta``: JSON-able
    facts :func:`semzo.checkpoint.tools.export` needs to rebuild the model (``{"head":
    {"n_classes", "normalize"}, "lora": {"rank", "alpha", "targets"}}``).

    Raises :class:`CheckpointDirError` (every rank, exit 2) when the folder cannot be
    written, and :class:`~semzo.deck.DeckError` when ``async_save`` is asked for but MPI
    does not provide ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, comm, cfg: CheckpointSection | None = None,
                 outdir: str | Path | None = None, deck_toml: str = "",
                 topology: dict | None = None, *, shards_path: str | Path | None = None,
                 model_meta: dict | None = None) -> None:
        self.cfg = cfg or CheckpointSection()
        self.comm: MPI.Intracomm = comm.world if hasattr(comm, "world") else comm
        self.topology = topology if topology is not None else topology_info(comm)
        if self.cfg.dir:
            self.dir = Path(self.cfg.dir)
        elif outdir is not None:
            self.dir = Path(outdir) / "checkpoints"
        else:
            raise ValueError("Checkpointer needs cfg.dir or outdir")
        self.opts = WriteOptions.from_section(self.cfg)
        self.deck_toml = deck_toml
        self.model_meta = model_meta or {}
        self.last_step: int | None = None
        self.last_path: Path | None = None
        self.history: list[dict[str, float]] = []   # one record per completed save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._acomm: MPI.Intracomm | None = None
        self._background_ok: bool | None = None   # async_save: decided at the first save
        prepare_dir(self.dir, self.comm)
        if self.opts.checksum == "xxh64":
            fmt.digest("xxh64", b"")      # load the numba kernel now, not in the first save
        if self.cfg.async_save:
            levels = self.comm.allgather(MPI.Query_thread())
            if min(levels) < MPI.THREAD_MULTIPLE:
                raise DeckError(f"checkpoint.async_save: needs MPI_THREAD_MULTIPLE, MPI "
                                f"provides {_THREAD_LEVELS.get(min(levels), min(levels))} "
                                f"(set async_save = false, or initialize MPI with "
                                f"mpi4py.rc.thread_level = 'multiple')")
            self._acomm = self.comm.Dup()      # the writer thread's own communicator
        self.shards_path = str(Path(shards_path).resolve()) if shards_path else ""
        manifest, err = "", None
        if self.comm.Get_rank() == 0:
            if shards_path:
                try:
                    manifest = manifest_checksum(shards_path)
                except OSError as exc:
                    err = f"{shards_path}: cannot read the shard manifest: {exc}"
            for p in [*self.dir.glob("ckpt-*.h5.tmp"), *self.dir.glob(BEST + ".tmp")]:
                log.warning("removing %s, left by an interrupted checkpoint write", p)
                p.unlink(missing_ok=True)
        manifest, err = self.comm.bcast((manifest, err), root=0)
        if err:
            raise AllRanksError(err)
        self.shards_manifest = manifest

    # ------------------------------------------------------------------ public API
    def due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every_steps`` (and positive)."""
        n = self.cfg.every_steps
        return n > 0 and step > 0 and step % n == 0

    def maybe_save(self, step: int, params: dict, state: dict | None = None,
                   per_rank: dict | None = None, extras: dict | None = None,
                   metrics: dict | None = None) -> Path | None:
        """:meth:`save` when :meth:`due`; otherwise only report a failed background write.
        Collective over the world when it saves."""
        self.poll()
        if not self.due(step):
            return None
        return self.save(step, params, state, per_rank, extras, metrics)

    def save(self, step: int, params: dict, state: dict | None = None,
             per_rank: dict | None = None, extras: dict | None = None,
             metrics: dict | None = None) -> Path:
        """Write the checkpoint of ``step``; returns its final path. Collective over the world.

        Arguments as in :func:`semzo.checkpoint.writer.prepare`. Synchronous mode returns when
        the file is complete, ``latest`` points at it and old ones are pruned. With
        ``async_save`` it returns once this rank's share is copied; the write goes on in a
        background thread (a second save first waits for the first). Saving the step saved
        last is a no-op.
        """
        self.wait()
        if step == self.last_step and self.last_path is not None:
            return self.last_path
        t0 = time.perf_counter()
        comm = self.comm
        root = self._root(metrics)
        if self._acomm is not None and self._background_ok is None:
            self._background_ok = self._decide()
        background = self._acomm is not None and bool(self._background_ok)
        # a background writer must not wait for the other ranks at every tensor: its data
        # transfers are independent whatever the deck says (metadata stays collective)
        opts = dataclasses.replace(self.opts, transfer="independent") if background \
            else self.opts
        payload = prepare(comm, step, params, state, per_rank, extras, metrics, root,
                          opts=opts, copy=background)
        self._check_room(payload.nbytes)
        path = self.dir / fmt.checkpoint_name(step)
        snap = time.perf_counter() - t0
        if not background:
            self._publish(payload, path, comm, t0, snap)
        else:
            self._thread = threading.Thread(target=self._background, name="semzo-ckpt",
                                            args=(payload, path, self._acomm, t0, snap),
                                            daemon=True)
            self._thread.start()
        self.last_step, self.last_path = int(step), path
        return path

    def _check_room(self, nbytes: int) -> None:
        """Rank 0 makes the folder and checks it has room for ``nbytes`` (skipped with
        ``SEMZO_CKPT_SKIP_SPACE_CHECK=1``); its error is raised on every rank. Collective."""
        err = None
        if self.comm.Get_rank() == 0 and os.environ.get("SEMZO_CKPT_SKIP_SPACE_CHECK") != "1":
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                err = check_space(self.dir, nbytes)
            except OSError as exc:
                err = f"checkpoint dir {self.dir}: cannot write: {exc.strerror or exc}"
        _agree_error(self.comm, err)

    def _root(self, metrics: dict | None) -> dict:
        created = self.comm.bcast(time.strftime("%Y-%m-%dT%H:%M:%S%z"), root=0)
        return {"semzo_deck": self.deck_toml, "created": created,
                "topology": json.dumps(self.topology, sort_keys=True),
                "metrics": json.dumps({k: float(v) for k, v in (metrics or {}).items()}),
                "shards_path": self.shards_path, "shards_manifest": self.shards_manifest,
                "model_meta": json.dumps(self.model_meta, sort_keys=True)}

    def save_best(self, step: int, params: dict, state: dict | None = None,
                  per_rank: dict | None = None, extras: dict | None = None,
                  metrics: dict | None = None) -> Path:
        """Write the checkpoint of the best held-out model so far to ``BEST`` (``best.h5``) in
        the folder, atomically (``best.h5.tmp``, then renamed over the previous one), apart
        from the rolling checkpoints: never pruned, never a resume candidate, not named by
        ``latest``. Synchronous. Collective over the world."""
        self.wait()
        t0 = time.perf_counter()
        comm = self.comm
        payload = prepare(comm, step, params, state, per_rank, extras, metrics,
                          self._root(metrics), opts=self.opts, copy=False)
        self._check_room(payload.nbytes)
        path = self.dir / BEST
        write_file(payload, path, comm)
        log.info("best held-out model so far (step %d) -> %s (%.2f s)", step, path,
                 time.perf_counter() - t0)
        return path

    def load_best(self) -> Loaded:
        """Read ``best.h5`` back (one verified read; :class:`CheckpointError` on every rank when
        it is missing or damaged). Collective over the world."""
        self.wait()
        return load(self.dir / BEST, self.comm)

    def resume(self, *, shard_size: int | None = None) -> Loaded | None:
        """The newest valid checkpoint of this run's folder, or None (also with ``resume =
        "never"``). Collective. Later saves of the step it holds are no-ops. Warns when the
        shard manifest differs from the one the checkpoint was written with."""
        if self.cfg.resume == "never":
            return None
        loaded = resume(self.dir, self.comm, shard_size=shard_size)
        if loaded is not None:
            self.last_step, self.last_path = loaded.step, loaded.path
            stored = str(loaded.attrs.get("shards_manifest", ""))
            if stored and self.shards_manifest and stored != self.shards_manifest \
                    and self.comm.Get_rank() == 0:
                log.warning("%s was written with another shards.h5 (manifest %s, now %s): "
                            "data cursors point into other shards", loaded.path.name, stored,
                            self.shards_manifest)
        return loaded

    @property
    def background(self) -> bool:
        """True when saves go on in a background thread: ``async_save`` asked for and the
        first save found a free core (:func:`choose_async`); False before that save."""
        return self._acomm is not None and bool(self._background_ok)

    def wait(self) -> None:
        """Block until a background write is complete; re-raise its error on this rank."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def poll(self) -> None:
        """Re-raise the error of a finished background write (does not block)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def close(self) -> None:
        """Wait for a background write and free the writer's communicator. Collective."""
        try:
            self.wait()
            if len(self.history) > 1:
                h = self.history
                log.info("checkpoints: %d saved in %s (steps %d..%d), %.2f s of writing in all, "
                         "latest -> %s", len(h), self.dir, h[0]["step"], h[-1]["step"],
                         sum(x["seconds"] for x in h), read_latest(self.dir) or "(none)")
        finally:
            if self._acomm is not None:
                self._acomm.Free()
                self._acomm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    # ------------------------------------------------------------------ internals
    def _decide(self) -> bool:
        """``async_save``: background or synchronous saves for this run, decided once at the
        first save from the free cores and the load of every node (:func:`choose_async`),
        the same on
        every rank, logged once. Collective."""
        cores, ranks, threads, load = _node_cores(self.comm)
        ok, why = choose_async(cores, ranks, threads, os.environ.get(ASYNC_ENV, ""), load)
        ok = bool(self.comm.allreduce(int(ok), op=MPI.MIN))    # one mode for all ranks
        if self.comm.Get_rank() == 0:
            log.info("checkpoint.async_save: %s: %s", "asynchronous" if ok else "synchronous",
                     why)
        return ok

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _background(self, payload, path, comm, t0, snap) -> None:
        try:
            self._publish(payload, path, comm, t0, snap)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            log.error("background checkpoint write of %s failed on this rank: %s", path, exc)
            self._error = exc

    def _publish(self, payload, path: Path, comm: MPI.Intracomm, t0: float,
                 snap: float) -> None:
        """Write the file, then move ``latest`` and prune (rank 0). Collective over comm."""
        tw = time.perf_counter()
        write_file(payload, path, comm)
        write_s = time.perf_counter() - tw
        err = None
        if comm.Get_rank() == 0:
            try:
                write_latest(self.dir, path.name)
                for p in prune(self.dir, self.cfg.keep):
                    log.debug("removed old checkpoint %s", p.name)
            except OSError as exc:
                err = f"checkpoint dir {self.dir}: cannot update {LATEST}: {exc.strerror}"
        err = comm.bcast(err, root=0)
        if err:
            raise AllRanksError(err)
        total = time.perf_counter() - t0
        mib = payload.nbytes / 2**20
        self.history.append({"step": payload.step, "bytes": payload.nbytes, "seconds": total,
                             "write_seconds": write_s, "snapshot_seconds": snap})
        # the first save is logged (where and how fast), the others at debug level: a run
        # with a checkpoint every few steps would print a line per save; close() sums them up
        log.log(logging.INFO if len(self.history) == 1 else logging.DEBUG,
                "checkpoint step %d: %.1f MiB in %.2f s (%.0f MiB/s) -> %s%s", payload.step,
                mib, write_s, mib / max(write_s, 1e-9), path,
                " (later saves: one line at the end)" if len(self.history) == 1 else "")


# --------------------------------------------------------------------------- restarting
def _candidates(d: Path, comm: MPI.Intracomm) -> list[Path]:
    c = None
    if comm.Get_rank() == 0:
        c = [str(p) for _, p in reversed(list_checkpoints(d))]
        latest = read_latest(d)
        if c and latest and Path(c[0]).name != latest:
            log.warning("%s: `latest` names %s but %s is newer; checking newest first",
                        d, latest, Path(c[0]).name)
    return [Path(p) for p in comm.bcast(c, root=0)]


def find_resumable(d: str | Path, comm: MPI.Intracomm, *,
                   transfer: str = "independent") -> Path | None:
    """The newest checkpoint in ``d`` that verifies, or None. Collective over ``comm``:
    every rank gets the same answer. Incomplete or corrupt files are skipped with a
    warning naming the reason."""
    for p in _candidates(Path(d), comm):
        ok, why = verify(p, comm, transfer=transfer)
        if ok:
            return p
        if comm.Get_rank() == 0:
            log.warning("skipping checkpoint %s", why)
    return None


def find_model_checkpoint(path: str | Path, comm: MPI.Intracomm) -> tuple[Path | None, str]:
    """The checkpoint ``export`` and ``generate`` take from a folder: a run folder (its
    ``checkpoints/``) or a checkpoint folder. ``best.h5`` (the best held-out model, see
    :meth:`Checkpointer.save_best`) when it is there and verifies, else the newest valid
    rolling checkpoint. Returns (path or None, "best" / "newest"). Collective over ``comm``."""
    d = Path(path)
    if (d / "checkpoints").is_dir() and not list_checkpoints(d) and not (d / BEST).is_file():
        d = d / "checkpoints"
    best = d / BEST
    there = comm.bcast(best.is_file() if comm.Get_rank() == 0 else None, root=0)
    if there:
        ok, why = verify(best, comm)
        if ok:
            return best, "best"
        if comm.Get_rank() == 0:
            log.warning("skipping checkpoint %s", why)
    return find_resumable(d, comm), "newest"


def resume(d: str | Path, comm: MPI.Intracomm, *, shard_size: int | None = None,
           transfer: str = "independent") -> Loaded | None:
    """Load the newest valid checkpoint of ``d`` (one verified read; corrupt ones skipped
    with a warning), or None when there is none. Collective over ``comm``.
    ``shard_size``: this rank's shard size now (see :func:`load`)."""

    for p in _candidates(Path(d), comm):
        try:
            return load(p, comm, shard_size=shard_size, transfer=transfer)
        except CheckpointError as exc:
            if comm.Get_rank() == 0:
                log.warning("skipping checkpoint %s", exc)
    return None

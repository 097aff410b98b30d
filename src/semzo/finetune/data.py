"""Fine-tuning data: this rank's rows of ``shards.h5``, the held-out split, deterministic and
resumable batches.

* Rows: rank r reads ``rank_offsets[r]:rank_offsets[r+1]`` (the place stage's shard) when the
  world has as many ranks as wrote the file, else a balanced contiguous block.
* Weights (heterogeneous ranks): ``rank_weights`` as the place stage stored them, when the
  shards are this world's.
* Held-out split: sample ``id`` is held out when ``u(id) < fraction``, ``u`` a Philox hash of
  the id keyed by the run seed: the split does not depend on the number of ranks.
* Order: a cursor (epoch, position) walks a per-epoch permutation of the rank's training rows;
  the permutation is the argsort of Philox hashes of (position, epoch, rank) keyed by the run
  seed, so the order is a pure function of (seed, epoch, rank) and a cursor resumes it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..h5check import (
    DAMAGED,
    agree,
    attr_int,
    finite_error,
    offsets_error,
    range_error,
    shape_error,
)
from ..h5io import open_collective, read_slab, read_texts, row_range
from ..place.weights import batch_shares
from ..rng import philox_hash
from ..runtime import get_logger

log = get_logger(__name__)

_DOMAIN_PERM = 0x9E11


@dataclass
class ShardRows:
    """One rank's rows of shards.h5 (numpy, host memory)."""

    ids: np.ndarray          # (n,) int64
    labels: np.ndarray       # (n,) int64, -1 = no label
    embeddings: np.ndarray   # (n, H) float32, L2-normalized (embed stage)
    texts: list[str]
    label_names: list[str]
    offset: int              # global row of the first row
    n_total: int
    deck_toml: str = ""      # the resolved deck that wrote the file
    rank_weights: np.ndarray | None = None   # (P,) the place stage's weights (this world's P)


def read_shard(path, comm: MPI.Intracomm, *, with_embeddings: bool = True) -> ShardRows:
    """Read this rank's shard of ``shards.h5``. Collective over comm."""
    with open_collective(path, comm, missing="run the place stage first") as f:
        n_total, err = attr_int(path, f, "n_total")
        err = err or shape_error(path, f, {
            "ids": (n_total, 1), "labels": (n_total, 1), "embeddings": (n_total, 2),
            "text_offsets": (n_total + 1, 1), "text_bytes": (-1, 1), "rank_offsets": (-1, 1)})
        offs = np.zeros(0, np.int64)
        if err is None:
            offs = f["rank_offsets"][...]
            err = offsets_error(path, "rank_offsets", offs, 0, n_total)
            if err is None and (offs.size < 2 or offs[0] != 0 or offs[-1] != n_total):
                err = (f"{path}: dataset rank_offsets: {offs.size} offsets from "
                       f"{offs[0] if offs.size else '-'} to {offs[-1] if offs.size else '-'}, "
                       f"expected 0 to n_total = {n_total}: {DAMAGED}")
        agree(comm, err)
        wts = None
        if len(offs) == comm.Get_size() + 1:
            lo, hi = int(offs[comm.Get_rank()]), int(offs[comm.Get_rank() + 1])
            if "rank_weights" in f:
                wts = np.asarray(f["rank_weights"][...], np.float64).reshape(-1)
                if wts.size != comm.Get_size() or not (np.all(np.isfinite(wts))
                                                       and wts.min() > 0):
                    err = (f"{path}: dataset rank_weights: {wts.tolist()}, expected "
                           f"{comm.Get_size()} positive numbers: {DAMAGED}")
                agree(comm, err)
        else:
            if comm.Get_rank() == 0:
                log.warning("%s was written by %d ranks, this run has %d: rows are split in "
                            "balanced blocks instead of the placement's shards", path,
                            len(offs) - 1, comm.Get_size())
            lo, hi = row_range(n_total, comm)
        # checked as stored (float ids such as 3.5 are refused, not truncated), then cast
        ids = read_slab(f["ids"], lo, hi)
        labels = read_slab(f["labels"], lo, hi)
        emb = read_slab(f["embeddings"], lo, hi) if with_embeddings else \
            np.zeros((hi - lo, 0), np.float32)
        names = [s.decode() if isinstance(s, bytes) else str(s)
                 for s in f.attrs.get("label_names", [])]
        agree(comm, range_error(path, "labels", labels, -1, len(names), row0=lo,
                                what=f"-1 = no label, {len(names)} label names")
              or range_error(path, "ids", ids, 0, None, row0=lo)
              or range_error(path, "ids", ids, 0, 2**63, row0=lo, what="sample ids are int64")
              or (finite_error(path, "embeddings", emb, row0=lo) if with_embeddings else None))
        ids, labels = ids.astype(np.int64), labels.astype(np.int64)
        texts = read_texts(f, lo, hi, comm, path)
        deck = f.attrs.get("semzo_deck", "")
    return ShardRows(ids=ids, labels=labels, embeddings=np.ascontiguousarray(emb, np.float32),
                     texts=texts, label_names=names, offset=lo, n_total=n_total,
                     deck_toml=deck.decode() if isinstance(deck, bytes) else str(deck),
                     rank_weights=wts)


def epoch_permutation(n: int, seed: int, epoch: int, rank: int) -> np.ndarray:
    """A permutation of range(n): argsort of Philox hashes of (position, epoch, rank)."""
    pos = np.arange(n, dtype=np.uint64)
    x0, x1 = philox_hash(pos, np.uint64(epoch), np.uint64(rank), _DOMAIN_PERM, seed)
    return np.argsort((np.asarray(x1, np.uint64) << np.uint64(32)) | x0, kind="stable")


class Batcher:
    """Batches of ``batch_size`` positions into ``n`` training rows, in the order of
    :func:`epoch_permutation`, from a cursor ``(epoch, pos)``; a batch that reaches the end of
    an epoch continues in the next one. Empty shards give empty batches."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int) -> None:
        self.n, self.batch_size, self.seed, self.rank = int(n), int(batch_size), seed, rank
        self._perm_epoch = -1
        self._perm = np.zeros(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(self.n, self.seed, epoch, self.rank)
            self._perm_epoch = epoch
        return self._perm

    def next(self, epoch: int, pos: int) -> tuple[np.ndarray, int, int]:
        """(row indices, new epoch, new pos)."""
        if self.n == 0:
            return np.zeros(0, np.int64), epoch, pos
        out = []
        need = min(self.batch_size, self.n) if self.batch_size > self.n else self.batch_size
        while need > 0:
            perm = self._permutation(epoch)
            take = perm[pos:pos + need]
            out.append(take)
            need -= take.size
            pos += take.size
            if pos >= self.n:
                epoch, pos = epoch + 1, 0
        return np.concatenate(out).astype(np.int64), epoch, pos


def local_batch(deck, topo, stored) -> int:
    """This rank's share of the global batch (``train.batch_size`` x ranks): equal, or in
    proportion to the weights the place stage stored in shards.h5 (``place.rank_weights``
    not ``"equal"``). The per-rank losses are combined weighted by batch size (the engine's
    exchange), so the ZO estimate stays the mean over the global batch."""
    t = deck.train
    if deck.place.rank_weights == "equal":
        return t.batch_size
    if stored is None:
        if topo.rank == 0:
            log.warning("place.rank_weights = %s, but shards.h5 holds no weights for %d ranks "
                        "(made by an older semzo or another number of ranks): equal batches",
                        deck.place.rank_weights, topo.size)
        return t.batch_size
    shares = batch_shares(t.batch_size, stored, topo.size)
    log.info("finetune: batch per rank in proportion to the rank weights: %s (global %d)",
             " ".join(map(str, shares.tolist())), int(shares.sum()))
    return int(shares[topo.rank])

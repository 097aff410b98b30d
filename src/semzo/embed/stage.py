"""The embed stage: JSONL slice -> sentence embeddings -> ``embeddings.h5`` (collective).

``embeddings.h5`` layout (rows in global corpus order)::

    embeddings   (N, H) float32   L2-normalized sentence embeddings
    ids          (N,)   int64     record ids (the corpus's ``id``, else the record number)
    labels       (N,)   int64     index into the ``label_names`` attribute, -1 without labels
    text_offsets (N+1,) int64     UTF-8 text of row i is text_bytes[off[i]:off[i+1]]
    text_bytes   (B,)   uint8
    attrs: semzo_deck (resolved deck), label_names, model, n_total, seconds, docs_per_second
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..corpus import label_codes, label_vocab, read_corpus_slice
from ..corpus.records import record_kind
from ..h5check import DAMAGED, agree, attr_int, finite_error, range_error, shape_error
from ..h5io import (
    create_collective,
    offsets,
    open_collective,
    read_slab,
    read_texts,
    row_range,
    string_array,
    write_rows,
    write_texts,
)
from ..model import Tokenizer, embed_texts, load_model, set_threads
from ..preflight import check_later_stages, embed_model_path
from ..runtime import AllRanksError, SemzoError, get_logger

log = get_logger(__name__)


@dataclass
class EmbeddedRows:
    """A block of rows of embeddings.h5 held by one rank."""

    embeddings: np.ndarray     # (n, H) float32
    ids: np.ndarray            # (n,) int64
    labels: np.ndarray         # (n,) int64
    texts: list[str]
    offset: int                # global index of the first row
    n_total: int
    label_names: list[str]
    file_id: str = ""          # semzo_file_id of embeddings.h5 ("" for older files)
    deck_toml: str = ""        # the deck embeddings.h5 was made with


def subset_mask(first: int, n_local: int, n_total: int, m: int) -> np.ndarray:
    """Which of records [first, first + n_local) belong to an evenly spaced subset of ``m``
    of ``n_total`` records: record i is kept when floor(i m / N) steps up. The subset does not
    depend on the number of ranks, and every rank keeps about its share."""
    i = np.arange(first, first + n_local, dtype=np.int64)
    return (i * m) // n_total != ((i - 1) * m) // n_total


def filter_labels(deck, comm, texts, ids, labels_s):
    """Keep the records whose label is in ``corpus.labels``. Returns ``(texts, ids, labels,
    first, n_total)`` with ``first`` the global index of this rank's first kept record among
    all kept records (so ``max_records`` subsets stay independent of the rank count).
    Collective over comm (one exscan, one allreduce); a label never seen anywhere is an error
    on every rank."""

    want = set(deck.corpus.labels)
    if labels_s is None:
        err = SemzoError(f"{deck.source}: corpus.labels: the corpus {deck.corpus.path} has no "
                         f"labels")
        err.all_ranks = True
        raise err
    keep = np.array([x in want for x in labels_s], bool)
    seen = sorted(want & set(labels_s))
    n_kept = int(keep.sum())
    first = comm.exscan(n_kept) or 0
    n_total = comm.allreduce(n_kept)
    found = set().union(*comm.allgather(seen))
    missing = sorted(want - found)
    if missing:
        err = SemzoError(f"{deck.source}: corpus.labels: no record of {deck.corpus.path} has "
                         f"label {missing[0]!r}")
        err.all_ranks = True
        raise err
    texts = [t for t, k in zip(texts, keep) if k]
    labels_s = [x for x, k in zip(labels_s, keep) if k]
    return texts, ids[keep], labels_s, int(first), int(n_total)


def run_embed_stage(ctx) -> dict:
    """Collective. Reads the corpus slice, embeds it, writes embeddings.h5."""

    deck, topo = ctx.deck, ctx.topo
    comm = topo.world
    # sft and choice records: texts hold each record's canonical JSON (what the finetune
    # stage reads back), part.embed what is embedded for sharding (corpus/records.py)
    part = read_corpus_slice(deck.corpus.path, comm, record_kind(deck.train.task))
    texts, ids, labels_s = part.texts, part.ids, part.labels
    first, n_total = part.first_record, part.n_total
    structured = part.embed is not None
    if structured:
        texts = list(zip(texts, part.embed, part.lines.tolist()))
    if deck.corpus.labels:
        texts, ids, labels_s, first, n_total = filter_labels(
            deck, comm, texts, ids, labels_s)
    if deck.corpus.max_records and deck.corpus.max_records < n_total:
        keep = subset_mask(first, len(texts), n_total, deck.corpus.max_records)
        texts = [t for t, k in zip(texts, keep) if k]
        ids = ids[keep]
        labels_s = [x for x, k in zip(labels_s, keep) if k] if labels_s is not None else None
    if n_total == 0:                      # before anything counts clusters or classes
        raise AllRanksError(f"{deck.corpus.path}: the corpus has no records"
                            + (" with a label in corpus.labels" if deck.corpus.labels else ""))
    records = None
    if structured:
        records = texts
        texts = [r[0] for r in records]
    vocab = label_vocab(labels_s, comm)
    labels = (label_codes(labels_s, vocab) if labels_s is not None
              else np.full(len(texts), -1, np.int64))
    check_later_stages(ctx, ids, labels, vocab, records)
    model_path, key = embed_model_path(deck)
    model = load_model(model_path, xp=ctx.xp, dtype=deck.model.dtype)
    if model.kind != "encoder":

        err = SemzoError(f"{deck.source}: {key}: the embed stage needs an encoder, "
                         f"got a {model.kind}")
        err.all_ranks = True
        raise err
    model.inference_layout()    # transposed projection weights: faster GEMMs, same bits
    tok = Tokenizer.from_folder(model_path, max_length=deck.model.max_length)
    set_threads(ctx.threads)    # a rank owning several cores splits each batch over them
    t0 = time.perf_counter()
    emb = embed_texts(model, tok, texts if records is None else [r[1] for r in records],
                      batch_size=deck.embed.batch_size).astype(np.float32)
    dt = time.perf_counter() - t0
    with ctx.timer.comm():
        off, total = offsets(len(texts), comm)
        slowest = comm.allreduce(dt, op=MPI.MAX)
    if total == 0:

        err = SemzoError(f"{deck.corpus.path}: the corpus has no records")
        err.all_ranks = True
        raise err
    log.info("embedded %d texts on %d ranks in %.1f s (%.0f texts/s overall, %s)",
             total, comm.Get_size(), slowest, total / max(slowest, 1e-9),
             model_path or "all-MiniLM-L6-v2")
    write_embeddings(ctx.path("embeddings.h5"), comm, ctx.deck.to_toml(), emb, ids, labels,
                     texts, off, total, vocab, seconds=slowest)
    return {"texts": total, "labels": len(vocab), "texts/s": total / max(slowest, 1e-9)}


def write_embeddings(path, comm, deck_toml: str, emb, ids, labels, texts, off: int,
                     total: int, vocab: list[str], seconds: float = 0.0) -> None:
    """Write one rank's rows of embeddings.h5 at global row ``off``. Collective."""
    with create_collective(path, comm, deck_toml, n_total=total,
                           label_names=string_array(vocab),
                           seconds=seconds, docs_per_second=total / max(seconds, 1e-9)) as f:
        write_rows(f, "embeddings", emb, off, total)
        write_rows(f, "ids", ids.astype(np.int64), off, total)
        write_rows(f, "labels", labels.astype(np.int64), off, total)
        write_texts(f, texts, off, total, comm)


def read_embeddings(path, comm, *, lo: int | None = None, hi: int | None = None,
                    with_text: bool = True) -> EmbeddedRows:
    """Read rows [lo, hi) of embeddings.h5 (default: this rank's balanced block). Collective."""
    with open_collective(path, comm, missing="run the embed stage first") as f:
        n, err = attr_int(path, f, "n_total")
        err = err or shape_error(path, f, {"embeddings": (n, 2), "ids": (n, 1), "labels": (n, 1),
                                           "text_offsets": (n + 1, 1), "text_bytes": (-1, 1)})
        if err is None and f["embeddings"].dtype.kind != "f":
            err = (f"{path}: dataset embeddings: expected floats, got "
                   f"{f['embeddings'].dtype} ({DAMAGED})")
        agree(comm, err)
        if lo is None or hi is None:
            lo, hi = row_range(n, comm)
        emb = read_slab(f["embeddings"], lo, hi)
        ids = read_slab(f["ids"], lo, hi)
        labels = read_slab(f["labels"], lo, hi)
        names = [s.decode() if isinstance(s, bytes) else str(s)
                 for s in f.attrs.get("label_names", [])]
        agree(comm, range_error(path, "labels", labels, -1, len(names), row0=lo,
                                what=f"-1 = no label, {len(names)} label names")
              or range_error(path, "ids", ids, 0, None, row0=lo)
              or range_error(path, "ids", ids, 0, 2**63, row0=lo, what="sample ids are int64")
              or finite_error(path, "embeddings", emb, row0=lo))
        texts = read_texts(f, lo, hi, comm, path) if with_text else []
        file_id, deck = f.attrs.get("semzo_file_id", ""), f.attrs.get("semzo_deck", "")
    return EmbeddedRows(embeddings=np.ascontiguousarray(emb, np.float32), ids=ids,
                        labels=labels, texts=texts, offset=lo, n_total=n, label_names=names,
                        file_id=_text(file_id), deck_toml=_text(deck))


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

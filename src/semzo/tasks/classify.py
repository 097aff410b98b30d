"""Classification tasks: a classification head on an encoder or decoder (:class:`ClassifyTask`),
the head alone on frozen features (:class:`FeatureClassifyTask`), and the frozen lower blocks
computed once (:class:`PrefixCachedClassifyTask`); the head's nearest-class-mean start
(:func:`init_head_class_means`) and the features the head-only task reads
(:func:`head_features`)."""

from __future__ import annotations

import numpy as np

from ..deck import from_toml_text
from ..model import Tokenizer, embed_texts
from ..model.base import cross_entropy
from ..model.storage import to_float32
from ..preflight import embed_model_path
from ..runtime import AllRanksError
from .base import Task, pad_batch


class ClassifyTask(Task):
    """Sequence classification: mean cross-entropy of the model's classification head."""

    kind = "classify"

    def loss(self, batch) -> float:
        ids, mask, labels, n = batch
        if n == 0:
            return 0.0
        return self.model.classify(ids, mask, labels)[0]

    def loss_from_state(self, state, batch) -> float:
        return self.score_from_state(state, batch)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self.model.classify_hidden(state.hidden, state.maskf, batch[2])[:2]

    def eval_batch(self, rows) -> tuple[float, float]:
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return self.model.classify(ids, mask, self.labels[rows])[:2]


class FeatureClassifyTask(Task):
    """Classification when only the head trains: the frozen encoder's pooled, L2-normalized
    features of every row are computed once (``features`` (n, H) float32), and each loss is the
    head on them -- the same arithmetic as ``model.classify`` with ``head.normalize``."""

    kind = "classify"

    def __init__(self, model, features: np.ndarray, labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, eval_batch_size: int) -> None:
        xp = model.xp
        self.model, self.labels = model, labels
        self.feats = xp.asarray(np.ascontiguousarray(features, np.float32))
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        self.eval_batches = [heldout_rows[i:i + eval_batch_size]
                             for i in range(0, len(heldout_rows), eval_batch_size)]

    def batch(self, positions: np.ndarray):
        rows = self.train_rows[positions]
        return rows, None, self.labels[rows], len(rows)

    def _loss_acc(self, rows) -> tuple[float, float]:
        xp, p = self.model.xp, self.model.params
        w = to_float32(p["classifier.weight"])
        b = to_float32(p["classifier.bias"])
        logits = self.feats[xp.asarray(rows)] @ w.T + b
        return cross_entropy(xp, logits, xp.asarray(self.labels[rows]).astype(xp.int64))

    def loss(self, batch) -> float:
        rows, _, _, n = batch
        return self._loss_acc(rows)[0] if n else 0.0

    def stage_count(self) -> int:
        return 1

    def stage_params(self, k: int) -> list[str]:
        return ["classifier.weight", "classifier.bias"]

    def stage_rows(self, batch) -> dict:
        return {}                  # the features are fixed: no embedding matrix is read

    def stage_begin(self, batch):
        return batch[0] if batch[3] else None

    def stage_fork(self, state):
        return state

    def stage_run(self, k: int, state):
        return state

    def loss_from_state(self, state, batch) -> float:
        return self._loss_acc(state)[0] if state is not None else 0.0

    def score_from_state(self, state, batch) -> tuple[float, float]:
        return self._loss_acc(state) if state is not None else (0.0, 0.0)

    def eval_inputs(self, rows):
        return rows, None, self.labels[rows], len(rows)

    def eval_batch(self, rows) -> tuple[float, float]:
        return self._loss_acc(rows)


class PrefixCachedClassifyTask(Task):
    """Classification when the lower ``layer`` blocks (and the embeddings) are frozen: the
    residual stream entering block ``layer`` is computed once per row (``model.hidden_at``) and
    kept, ``sum(len_i) x H`` values in the model dtype; each loss runs blocks ``layer .. L-1``,
    pooling and the head (``model.hidden_from``) -- the same arithmetic as
    :class:`ClassifyTask` (equal up to rounding: the cache is computed in other batches, with
    other padding lengths, so GEMM shapes differ), about ``L / (L - layer)`` times cheaper."""

    kind = "classify"

    def __init__(self, model, seqs: list[np.ndarray], labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, pad_id: int,
                 eval_batch_size: int, layer: int) -> None:
        super().__init__(model, seqs, labels, train_rows, heldout_rows, pad_id, eval_batch_size)
        xp = model.xp
        self.layer = layer
        lens = np.array([len(q) for q in seqs], np.int64)
        self.offs = np.concatenate(([0], np.cumsum(lens)))
        self.cache = xp.empty((int(self.offs[-1]), model.config.hidden_size), model.dtype)
        order = np.argsort(-lens, kind="stable")          # similar lengths share a batch
        for i in range(0, len(order), eval_batch_size):
            rows = order[i:i + eval_batch_size]
            ids, mask = pad_batch([seqs[r] for r in rows], pad_id)
            x = model.hidden_at(ids, mask, layer)
            for j, r in enumerate(rows):
                self.cache[self.offs[r]:self.offs[r + 1]] = x[j, :lens[r]]

    @staticmethod
    def nbytes(seqs: list[np.ndarray], hidden: int, itemsize: int) -> int:
        return sum(len(q) for q in seqs) * hidden * itemsize

    def _inputs(self, rows):
        xp = self.model.xp
        lens = self.offs[np.asarray(rows) + 1] - self.offs[np.asarray(rows)]
        t = int(lens.max()) if len(rows) else 0
        x = xp.zeros((len(rows), t, self.cache.shape[1]), self.cache.dtype)
        mask = np.zeros((len(rows), t), np.float32)
        for j, r in enumerate(rows):
            x[j, :lens[j]] = self.cache[self.offs[r]:self.offs[r + 1]]
            mask[j, :lens[j]] = 1.0
        return x, xp.asarray(mask)

    def batch(self, positions: np.ndarray):
        rows = self.train_rows[positions]
        x, mask = self._inputs(rows)
        return x, mask, self.labels[rows], len(rows)

    def _classify(self, x, mask, labels):
        hs = self.model.hidden_from(x, mask, self.layer)
        return self.model.classify_hidden(hs, mask, labels)

    def loss(self, batch) -> float:
        x, mask, labels, n = batch
        return self._classify(x, mask, labels)[0] if n else 0.0

    def stage_count(self) -> int:
        return self.model.n_stages - 1 - self.layer

    def stage_params(self, k: int) -> list[str]:
        return self.model.stage_names(self.layer + 1 + k)

    def stage_rows(self, batch) -> dict:
        return {}                  # stage 0 starts from the cached hidden states

    def stage_begin(self, batch):
        x, mask, _, n = batch
        return self.model.stage_start_from(x, mask, self.layer) if n else None

    def stage_run(self, k: int, state):
        return None if state is None else self.model.stage_forward(self.layer + 1 + k, state)

    def loss_from_state(self, state, batch) -> float:
        return self.score_from_state(state, batch)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self.model.classify_hidden(state.hidden, batch[1], batch[2])[:2]

    def eval_inputs(self, rows):
        x, mask = self._inputs(rows)
        return x, mask, self.labels[rows], len(rows)

    def eval_batch(self, rows) -> tuple[float, float]:
        x, mask = self._inputs(rows)
        return self._classify(x, mask, self.labels[rows])[:2]


def init_head_class_means(model, emb: np.ndarray, labels: np.ndarray, n_classes: int,
                          scale: float, topo) -> np.ndarray:
    """Nearest-class-mean head: ``classifier.weight[c] = scale * m_c / |m_c|`` (m_c the mean
    of the L2-normalized training embeddings of class c), ``classifier.bias[c] = log prior of
    c``; with ``head.normalize`` the logits are ``scale * cos(e, m_c) + log p_c``. One allreduce
    of per-class sums and counts. Collective over the world. Returns the class counts."""
    h = model.config.hidden_size
    if emb.shape[1] != h:
        raise AllRanksError(f"shards.h5 embeddings have {emb.shape[1]} dimensions, the model "
                          f"{h}: embed with the same model or set train.head_init = \"random\"")
    acc = np.zeros((n_classes, h + 1), np.float64)
    ok = labels >= 0
    np.add.at(acc[:, :h], labels[ok], emb[ok].astype(np.float64))
    np.add.at(acc[:, h], labels[ok], 1.0)
    topo.allreduce(acc)
    counts = acc[:, h]
    means = acc[:, :h] / np.maximum(counts, 1.0)[:, None]
    means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    prior = np.log(np.maximum(counts, 0.5) / max(counts.sum(), 1.0))
    xp = model.xp
    w, b = model.params["classifier.weight"], model.params["classifier.bias"]
    xp.copyto(w, model.to_param(scale * means))
    xp.copyto(b, model.to_param(prior))
    return counts


def features_in_shards(ctx, model, rows, max_len: int) -> bool:
    """Whether shards.h5's embeddings are the head's input features: made by the same model
    at the same max_length and dtype (the embed stage computes exactly those)."""
    src = from_toml_text(rows.deck_toml)
    return ((embed_model_path(src)[0] or "") == (ctx.deck.model.path or "") and
            src.model.max_length == max_len and src.model.dtype == ctx.deck.model.dtype and
            rows.embeddings.shape[1] == model.config.hidden_size)


def head_features(ctx, model, rows, max_len: int, batch_size: int) -> tuple[np.ndarray, str]:
    """Pooled, L2-normalized features (n, H) float32 of the rank's rows under the frozen
    encoder: the embeddings of shards.h5 when they were made by the same model at the same
    max_length (the embed stage computes exactly this), else one forward pass per row."""
    if features_in_shards(ctx, model, rows, max_len):
        return rows.embeddings, f"taken from shards.h5: same model, max_length {max_len}"
    tok = Tokenizer.from_folder(ctx.deck.model.path or None, max_length=max_len)
    feats = embed_texts(model, tok, rows.texts, batch_size=batch_size, normalize=True)
    return feats.astype(np.float32), f"one forward pass per row at max_length {max_len}"

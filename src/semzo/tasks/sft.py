"""Supervised fine-tuning of a decoder on instruction records (``train.task = "sft"``):
prompt/completion pairs and chat conversations (:mod:`semzo.corpus.records`), tokenized by
:class:`semzo.model.chat.InstructTokenizer` (conversations through the model's chat template,
plain concatenation without one).

* Loss: the next-token cross-entropy on the completion (assistant) tokens only, the prompt and
  template tokens masked out (as transformers' labels of -100), averaged per completion token
  over the batch; the same in the held-out evaluation, whose accuracy is the share of
  completion tokens predicted right.
* Generations: on a small fixed subset of the held-out rows (``train.gen_samples`` over all
  ranks) each evaluation also decodes greedily from the prompt and scores the text against the
  reference completion with SQuAD's exact match and token F1 (MeZO's generation metrics).
* Truncation keeps the completion: the prompt is cut from the left; a record whose completion
  alone exceeds ``train.max_length`` is an error (``train.overlong = "error"``: the embed stage
  names its file and line) or is left out and counted (``"skip"``).
"""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np
from mpi4py import MPI

from ..corpus.records import check_record, parse_stored
from ..model.chat import InstructTokenizer
from ..runtime import AllRanksError, SemzoError, get_logger, raise_first, together
from .base import Task, pad_batch
from .prefix import PrefixCached
from .prefix_store import PrefixStore, store_args
from .prompt import cache_layer

log = get_logger(__name__)


# ----------------------------------------------------------------------------- SQuAD metrics
def normalize_answer(s: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, ref: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(ref))


def token_f1(pred: str, ref: str) -> float:
    """SQuAD's token F1 of the normalized texts (1.0 when both are empty)."""
    p, r = normalize_answer(pred).split(), normalize_answer(ref).split()
    if not p or not r:
        return float(p == r)
    same = sum((Counter(p) & Counter(r)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(r)
    return 2 * prec * rec / (prec + rec)


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a)


def greedy(model, ids, n_new: int, eos: set) -> list[int]:
    """Greedy continuation of ``ids`` (the KV cache when the model has one); the end token
    that stops it is included."""
    ids = [int(i) for i in ids]
    n_new = min(n_new, int(model.config.max_positions) - len(ids))
    out: list[int] = []
    if n_new <= 0:
        return out
    cache = model.new_cache(1, len(ids) + n_new) if hasattr(model, "new_cache") else None
    if cache is not None:
        logits = _host(model.forward_cached(np.array([ids], np.int64), cache)[0, -1])
    else:
        logits = _host(model.logits(np.array([ids], np.int64))[0, -1])
    while True:
        nxt = int(np.argmax(logits))
        out.append(nxt)
        if nxt in eos or len(out) == n_new:
            return out
        if cache is not None:
            logits = _host(model.forward_cached(np.array([[nxt]], np.int64), cache)[0, -1])
        else:
            logits = _host(model.logits(np.array([ids + out], np.int64))[0, -1])


class SFTTask(PrefixCached, Task):
    """``seqs``: token ids per row; ``loss_masks``: bool per token, True on the tokens the loss
    predicts. ``gen_rows``: the held-out rows whose greedy generations are scored (with
    ``tk`` to decode, ``eos`` the ids that end a generation, ``topo`` to sum the scores over
    the ranks: :meth:`eval_sums` is then collective). ``layer > 0``: the frozen-prefix cache
    (:mod:`.prefix`; the caller checks that nothing below block ``layer`` trains)."""

    kind = "sft"

    def __init__(self, model, seqs, loss_masks, train_rows, heldout_rows, pad_id: int,
                 eval_batch_size: int, *, tk=None, eos=(), gen_rows=(), gen_tokens: int = 32,
                 topo=None, layer: int = 0, store: PrefixStore | None = None,
                 store_key: tuple = ()) -> None:
        super().__init__(model, seqs, np.full(len(seqs), -1, np.int64), train_rows,
                         heldout_rows, pad_id, eval_batch_size)
        self._init_cache(layer, eval_batch_size, store, store_key)
        self.loss_masks = loss_masks
        self.tk, self.eos, self.topo = tk, set(eos), topo
        self.gen_rows = np.asarray(gen_rows, np.int64)
        self.gen_tokens = int(gen_tokens)
        self.last_gen = None            # (exact match, F1, count) of the last evaluation
        self.examples: list = []        # (prompt, reference, generation) of this rank's rows

    def _rows_batch(self, rows):
        rows = np.asarray(rows, np.int64)
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        lw, _ = pad_batch([self.loss_masks[r].astype(np.int64) for r in rows], 0)
        return ids, mask, self.labels[rows], len(rows), lw.astype(np.float32) * mask, rows

    def batch(self, positions: np.ndarray):
        return self._rows_batch(self.train_rows[positions])

    def eval_inputs(self, rows):
        return self._rows_batch(rows)

    def batch_weight(self, batch) -> float:
        return float(batch[4][:, 1:].sum()) if batch[3] else 0.0

    # ------------------------------------------------------------------ loss
    def _score(self, state, batch, acc: bool):
        lw = self.model.xp.asarray(batch[4])
        return self.model.next_token_loss_from_hidden(state.hidden, state.ids, lw,
                                                      return_accuracy=acc)

    def loss(self, batch) -> float:
        if batch[3] == 0 or self.batch_weight(batch) == 0:
            return 0.0
        return float(self._score(self._full(batch), batch, False))

    def loss_from_state(self, state, batch) -> float:
        if state is None or self.batch_weight(batch) == 0:
            return 0.0
        return float(self._score(state, batch, False))

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None or self.batch_weight(batch) == 0:
            return 0.0, 0.0
        return self._score(state, batch, True)

    def eval_batch(self, rows) -> tuple[float, float]:
        b = self._rows_batch(rows)
        return self.score_from_state(self._full(b), b)

    def eval_sums(self, run=None) -> np.ndarray:
        """[completion-token loss sum, hits, completion tokens] over the rank's held-out rows;
        then the generation metrics (collective when ``topo`` is set)."""
        out = np.zeros(3)
        for rows in self.eval_batches:
            b = self.eval_inputs(rows)
            cnt = self.batch_weight(b)
            if cnt == 0:
                continue
            loss, acc = self.eval_batch(rows) if run is None else run(b)
            out += (loss * cnt, round(acc * cnt), cnt)
        if self.topo is not None and run is None and self.evaluating == "test":
            self.generation_metrics()          # of held-out records only, never validation
        return out

    def split_eval(self, is_val: np.ndarray) -> None:
        super().split_eval(is_val)
        self.gen_rows = self.gen_rows[~np.asarray(is_val, bool)[self.gen_rows]]

    # ------------------------------------------------------------------ generations
    def prompt_of(self, r: int) -> np.ndarray:
        m = self.loss_masks[r]
        return self.seqs[r][:int(np.argmax(m))] if m.any() else self.seqs[r]

    def reference_of(self, r: int) -> str:
        """The first run of loss tokens (the first completion or assistant turn), decoded."""
        m = self.loss_masks[r]
        a = int(np.argmax(m))
        b = a + int(np.argmin(m[a:])) if not m[a:].all() else len(m)
        return self._decode(self.seqs[r][a:b])

    def _decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids if int(i) not in self.eos],
                              skip_special_tokens=True).strip()

    def generation_metrics(self) -> tuple[float, float, int]:
        """Greedy generations of ``gen_rows`` scored against their references: (mean exact
        match, mean token F1, count) over all ranks (collective), logged on rank 0."""
        sums = np.zeros(3)
        self.examples = []
        for r in self.gen_rows:
            gen = self._decode(greedy(self.model, self.prompt_of(r), self.gen_tokens,
                                      self.eos))
            ref = self.reference_of(r)
            sums += (exact_match(gen, ref), token_f1(gen, ref), 1)
            self.examples.append((self._decode(self.prompt_of(r)), ref, gen))
        self.topo.allreduce(sums)
        n = int(sums[2])
        self.last_gen = (sums[0] / max(n, 1), sums[1] / max(n, 1), n)
        if n:
            log.info("held-out generations: exact match %.4f, token F1 %.4f (%d greedy "
                     "generations of at most %d tokens)", self.last_gen[0], self.last_gen[1],
                     n, self.gen_tokens)
        return self.last_gen


def _load_records(ctx, rows, kind: str) -> list[dict]:
    """The records stored in the shard texts (canonical JSON), each checked as a ``kind``
    record (:func:`semzo.corpus.records.check_record`, what the corpus reader checks): a text
    that is not one (shards placed for the other task, or a damaged file: an answer out of
    range, a missing field) stops every rank together, naming shards.h5, the smallest such
    record id and what is wrong. Collective (one allreduce, four on an error)."""
    out, bad, first = [], 0, None
    for t, i in zip(rows.texts, rows.ids):
        try:
            rec = parse_stored(t)
        except (ValueError, RecursionError):
            rec = None
        got = check_record(rec, kind) if isinstance(rec, dict) else "not a JSON object"
        if isinstance(got, str):
            bad += 1
            if first is None or int(i) < first[0]:
                first = (int(i), got)
            got = {}
        out.append(got)
    n = np.array([bad], np.int64)
    ctx.topo.allreduce(n)
    if n[0]:
        raise_first(ctx.topo.allreduce, None if first is None else first[0],
                    None if first is None else
                    f"{ctx.path('shards.h5')}: record id {first[0]}: {first[1]}: not a "
                    f"train.task = {kind} record ({int(n[0])} such records): were the shards "
                    f"placed for another task? (rerun from the embed stage with this deck)")
    return out


def encode_records(ctx, recs: list[dict], ids: np.ndarray, fit, max_len: int) -> list:
    """``fit(rec, max_len)`` of each record (:meth:`InstructTokenizer.sft` or ``.choice``); a
    record it refuses with a :class:`SemzoError` (a chat template that fails to render it, a
    choice of no tokens) stops every rank together, naming shards.h5 and the smallest such
    record id. Collective (one allreduce, three on an error)."""
    out, first = [], None
    for rec, i in zip(recs, ids):
        try:
            out.append(fit(rec, max_len))
        except SemzoError as exc:
            out.append(None)
            if first is None or int(i) < first[0]:
                first = (int(i), str(exc))
    raise_first(ctx.topo.allreduce, None if first is None else first[0],
                None if first is None else
                f"{ctx.path('shards.h5')}: record id {first[0]}: {first[1]}")
    return out


def _overlong_error(deck, topo, ids: np.ndarray, over: np.ndarray, what: str,
                    max_len: int) -> int:
    """The number of overlong records over all ranks; every rank raises together when
    ``train.overlong = "error"`` and there is one (the smallest id named)."""
    n = np.array([int(over.sum())], np.int64)
    topo.allreduce(n)
    if n[0] and deck.train.overlong == "error":
        first = np.array([int(ids[over].min()) if over.any() else 2**63 - 1], np.int64)
        topo.allreduce(first, op=MPI.MIN)
        raise AllRanksError(f"{deck.corpus.path}: record id {int(first[0])}: its {what} alone "
                            f"does not fit train.max_length = {max_len} tokens ({int(n[0])} "
                            f"such records); raise train.max_length or set train.overlong = "
                            f"\"skip\" to leave them out")
    return int(n[0])


def build_sft_task(ctx, model, names, rows, train_idx, held_idx, max_len: int,
                   cache: bool = True, is_val: np.ndarray | None = None) -> SFTTask:
    """The run's :class:`SFTTask` from the shard's records, with the frozen-prefix cache when
    ``cache`` and the trainable set allows it. ``is_val``: the validation rows among
    ``held_idx`` (``train.val_fraction``), never in the generation subset. Collective (a few
    allreduces)."""
    deck, topo, t = ctx.deck, ctx.topo, ctx.deck.train
    itok = together(topo.allreduce, InstructTokenizer.from_folder, deck.model.path)
    recs = _load_records(ctx, rows, "sft")
    seqs, masks, over = [], [], np.zeros(len(recs), bool)
    stats = np.zeros(3, np.int64)               # cut records, tokens cut, conversations
    encoded = encode_records(ctx, recs, rows.ids, itok.sft, max_len)
    for i, (rec, got) in enumerate(zip(recs, encoded)):
        stats[2] += "messages" in rec
        if got is None:
            over[i] = True
            seqs.append(np.zeros(0, np.int64))
            masks.append(np.zeros(0, bool))
            continue
        ids, lm, cut = got
        stats[:2] += (cut > 0, cut)
        seqs.append(ids)
        masks.append(lm)
    n_over = _overlong_error(deck, topo, rows.ids, over, "completion", max_len)
    topo.allreduce(stats)
    train_idx, held_idx = train_idx[~over[train_idx]], held_idx[~over[held_idx]]
    if stats[2] and itok.renderer is None:
        log.info("finetune: sft: the model has no chat template: conversations are plain "
                 "concatenations (each system/user turn and a newline, each assistant turn "
                 "and the end token)")
    layer = cache_layer(ctx, model, names, seqs, cache)
    log.info("finetune: sft task: loss on completion tokens only, sequences of at most %d "
             "tokens; %d records had their prompt cut from the left (%d tokens in all)%s%s",
             max_len, int(stats[0]), int(stats[1]),
             f"; {n_over} records left out: their completion alone is longer "
             f"(train.overlong = \"skip\")" if n_over else "",
             f"; blocks 0..{layer - 1} frozen: their output is computed once per record"
             if layer else "")
    k, p, r = t.gen_samples, topo.size, topo.rank
    mine = k * (r + 1) // p - k * r // p
    gen = held_idx if is_val is None else held_idx[~is_val[held_idx]]
    order = gen[np.argsort(rows.ids[gen], kind="stable")]
    eos = {itok.eos_id} if itok.eos_id is not None else set()
    return SFTTask(model, seqs, masks, train_idx, held_idx, itok.pad_id, t.eval_batch_size,
                   tk=itok.tk, eos=eos, gen_rows=order[:mine], gen_tokens=t.gen_tokens,
                   topo=topo if k else None, layer=layer, **store_args(ctx))

"""Prompt-based classification with a decoder (MeZO's tasks): a template around each text and
one label word per class; the loss is the cross-entropy over the label words' next-token logits
at the last real position of the prompt, and the accuracy is the share of rows whose label word
scores highest among the label words.

* :func:`label_word_ids` checks ``prompt.label_words`` (each ONE token of the tokenizer; the
  default is each label name with the leading space the template implies).
* :func:`encode_prompts` builds the token ids of every prompt: the text is truncated so that the
  whole template (its end included) fits ``max_len`` tokens.
* :class:`PromptTask`: the task (loss, evaluation, and the stage interface of the block-streamed
  schedule); with ``layer > 0`` the residual stream entering block ``layer`` is computed once per
  prompt and kept (the frozen-prefix cache of ``head+last`` on decoders), so that each loss runs
  only blocks ``layer .. L-1``, the final norm and the label-word rows of the LM head.

Every function here runs on one rank and is not collective.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model import Tokenizer
from ..model.base import BLOCK, cross_entropy
from ..model.storage import to_float32
from ..model.variants import softcap
from ..preflight import encode_text, label_word_ids
from ..runtime import AllRanksError, get_logger
from .base import Task, pad_batch
from .prefix_store import PrefixStore, fill_prefix_cache, store_args

log = get_logger(__name__)


def lm_head_weight(model):
    """The LM head matrix (V, E) of a decoder (the embedding matrix when tied), as stored
    (bfloat16: uint16 bits; upcast the rows you read with ``storage.to_float32``)."""
    return model.params[model.head_weight_name()]


def encode_prompts(tok, texts: list[str], template: str, max_len: int, context: int,
                   src: str) -> list[np.ndarray]:
    """Token ids (int64) of ``template`` with each text in place of ``{text}``: the tokens of
    the part up to and including the text (special tokens added as the tokenizer does) cut to
    leave room for the tokens of the rest, which are always kept whole. Errors name
    ``prompt.template`` (no ``{text}``, or a template that leaves no room for a text within
    ``max_len`` tokens) or ``train.max_length`` (beyond the model's ``context`` positions)."""
    if "{text}" not in template:
        raise AllRanksError(f"{src}: prompt.template: must contain {{text}}, got {template!r}")
    if max_len > context:
        raise AllRanksError(f"{src}: train.max_length: {max_len} tokens exceed the model's "
                          f"context of {context} positions")
    head, tail = template.split("{text}", 1)
    tail = tail.replace("{text}", "")
    tail_ids = encode_text(tok, tail, False) if tail else []
    fixed = len(encode_text(tok, head, True)) + len(tail_ids)
    if fixed + 1 > max_len:
        raise AllRanksError(f"{src}: prompt.template: the template alone is {fixed} tokens, "
                          f"longer than the prompt length of {max_len} tokens "
                          f"(train.max_length, model context {context}) minus one for the "
                          f"text")
    budget = max_len - len(tail_ids)
    encs = tok.tk.encode_batch([head + t for t in texts])
    tail_a = np.asarray(tail_ids, np.int64)
    return [np.concatenate([np.asarray(e.ids[:budget], np.int64), tail_a]) for e in encs]


def prompt_scores(model, hidden, maskf, word_ids, delta=None, keep=None):
    """float32 logits (B, C) of the label words at each row's last real position, from final
    hidden states ``hidden`` (B, T, E) and the mask (B, T); soft-capped as the model's LM head
    caps every logit (Gemma 2's ``final_logit_softcapping``: c tanh(z / c), elementwise, so
    the label words' rows alone give the same values). ``delta`` (C, E): trained additions
    to the label rows (``train.label_rows``); ``keep``: a list that receives the (B, E)
    hidden states the scores read."""
    xp = model.xp
    m = xp.asarray(maskf)
    last = xp.maximum(m.sum(axis=1).astype(xp.int64) - 1, 0)
    h = hidden[xp.arange(hidden.shape[0]), last]                    # (B, E)
    w = to_float32(lm_head_weight(model)[xp.asarray(word_ids)])     # (C, E), stored rows
    if delta is not None:
        w = w + delta
    if keep is not None:
        keep.append(h)
    z = (h @ w.T).astype(xp.float32, copy=False)
    cap = getattr(getattr(model, "config", None), "final_softcap", 0.0)
    if cap:
        softcap(z, cap)
    return z


def _supports_cache(model) -> bool:
    """True when the model's stage states are dataclasses with a ``hidden`` field that can be
    replaced (the decoders of semzo.model.causal)."""
    if not hasattr(model, "stage_start"):
        return False
    st = model.stage_start(np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))
    return dataclasses.is_dataclass(st) and hasattr(st, "hidden") and hasattr(st, "stage")


class PromptTask(Task):
    """MeZO-style prompt classification. ``seqs``: prompt token ids per row (from
    :func:`encode_prompts`); ``word_ids`` (C,) the label words' token ids; ``labels`` (n,)
    class indices. ``layer > 0``: the frozen-prefix cache (see the module docstring); the
    caller checks that nothing below block ``layer`` trains and :meth:`can_cache`."""

    kind = "prompt"

    def __init__(self, model, seqs, labels, train_rows, heldout_rows, pad_id: int,
                 eval_batch_size: int, word_ids: np.ndarray, layer: int = 0, *,
                 store: PrefixStore | None = None, store_key: tuple = ()) -> None:
        super().__init__(model, seqs, labels, train_rows, heldout_rows, pad_id, eval_batch_size)
        self.word_ids = np.asarray(word_ids, np.int64)
        self.layer = int(layer)
        self.cache = None
        self.cache_use = (0, 0, 0.0)        # sequences reused, computed; seconds
        # train.label_rows = "exact": a LabelRows (semzo.finetune.label_rows) whose delta the
        # scores add to the label rows and whose gradient every training loss feeds
        self.label_rows = None
        if self.layer > 0:
            self.cache_use = fill_prefix_cache(self, eval_batch_size, store,
                                               (*store_key, self.layer))

    can_cache = staticmethod(_supports_cache)

    @staticmethod
    def nbytes(seqs, hidden: int, itemsize: int) -> int:
        return sum(len(q) for q in seqs) * hidden * itemsize

    # ------------------------------------------------------------------ prefix cache
    def _run(self, st, lo: int, hi: int):
        for k in range(lo, hi):
            st = self.model.stage_forward(k, st)
        return st

    def _cached_state(self, rows, ids, mask):
        xp = self.model.xp
        st = self.model.stage_start(ids, mask)
        x = xp.zeros((len(rows), ids.shape[1], self.cache.shape[1]), self.cache.dtype)
        for j, r in enumerate(rows):
            x[j, :self.offs[r + 1] - self.offs[r]] = self.cache[self.offs[r]:self.offs[r + 1]]
        return dataclasses.replace(st, hidden=x, stage=self.layer + 1)

    # ------------------------------------------------------------------ loss
    def _rows_batch(self, rows):
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return ids, mask, self.labels[rows], len(rows), rows

    def batch(self, positions: np.ndarray):
        return self._rows_batch(self.train_rows[positions])

    def _hidden(self, batch):
        ids, mask, _, _, rows = batch
        if self.cache is None:
            return self.model.hidden_states(ids, mask)
        st = self._cached_state(rows, ids, mask)
        return self._run(st, self.layer + 1, self.model.n_stages).hidden

    def _loss_acc(self, hidden, batch, grad: bool = False) -> tuple[float, float]:
        """Cross-entropy and accuracy of the label words' scores; ``grad``: a training loss,
        whose label-row gradient goes to :attr:`label_rows` when it trains."""
        _, mask, labels, _, _ = batch
        lr = self.label_rows
        keep = [] if grad and lr is not None else None
        z = prompt_scores(self.model, hidden, mask, self.word_ids,
                          None if lr is None else lr.delta, keep)
        xp = self.model.xp
        y = xp.asarray(labels).astype(xp.int64)
        if keep:
            cap = getattr(getattr(self.model, "config", None), "final_softcap", 0.0)
            lr.add(keep[0], z, y, cap or 0.0)
        return cross_entropy(xp, z, y)

    def loss(self, batch) -> float:
        if batch[3] == 0:
            return 0.0
        return self._loss_acc(self._hidden(batch), batch, grad=True)[0]

    def eval_batch(self, rows) -> tuple[float, float]:
        b = self._rows_batch(np.asarray(rows))
        return self._loss_acc(self._hidden(b), b)

    def eval_inputs(self, rows):
        return self._rows_batch(np.asarray(rows))

    def predict(self, rows) -> np.ndarray:
        """Predicted class (n,) of rows ``rows`` (argmax over the label words)."""
        b = self._rows_batch(np.asarray(rows))
        z = prompt_scores(self.model, self._hidden(b), b[1], self.word_ids,
                          None if self.label_rows is None else self.label_rows.delta)
        z = z.get() if hasattr(z, "get") else z
        return np.argmax(np.asarray(z), axis=1)

    # ------------------------------------------------------------------ stages (streamed)
    @property
    def tied_head(self) -> bool:
        return bool(getattr(self.model, "tied_head", False)) and self.cache is None

    def stage_count(self) -> int:
        return self.model.n_stages - (self.layer + 1 if self.cache is not None else 0)

    def _first(self) -> int:
        return self.layer + 1 if self.cache is not None else 0

    def stage_params(self, k: int) -> list[str]:
        return self.model.stage_names(self._first() + k)

    def stage_rows(self, batch) -> dict:
        """The embedding rows the batch reads (see :meth:`_Task.stage_rows`); with a tied
        head also the label words' rows, the only rows of it the loss reads (so the
        streamed step can defer the others' perturbation, as for an untied model). Empty
        with the prefix cache (stage 0 starts from cached states)."""
        if self.cache is not None:
            return {}
        ids, n = batch[0], batch[3]
        if not self.tied_head:
            return super().stage_rows(batch)
        got = self.model.gather_rows(ids if n else np.zeros(0, np.int64))
        head = self.model.head_weight_name()
        if head not in got:
            return {}                     # the head reads a matrix stage 0 does not gather
        if n:
            got[head] = np.union1d(got[head], self.word_ids)
        return got

    def stage_begin(self, batch):
        ids, mask, _, n, rows = batch
        if n == 0:
            return None
        if self.cache is None:
            return self.model.stage_start(ids, mask)
        return self._cached_state(rows, ids, mask)

    def stage_fork(self, state):
        if state is None:
            return None
        return state.fork() if hasattr(state, "fork") else state

    def stage_run(self, k: int, state):
        return None if state is None else self.model.stage_forward(self._first() + k, state)

    def loss_from_state(self, state, batch) -> float:
        if state is None:
            return 0.0
        return self._loss_acc(state.hidden, batch, grad=True)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self._loss_acc(state.hidden, batch)


def first_trained_block(model, names: list[str]) -> int:
    """The first block with a trainable tensor when the embeddings and every block below it
    are frozen (then their output can be cached); 0 when nothing can be cached."""
    if model.lora and any(s.a in names for s in model.lora.values()):
        blocks = [int(m.group(1)) for s in model.lora.values() if s.a in names
                  for m in [BLOCK.search(s.a)] if m]
    else:
        blocks = [int(m.group(1)) for n in names if (m := BLOCK.search(n))]
    if not blocks or not hasattr(model, "stage_names"):
        return 0
    first = min(blocks)
    below = set(model.stage_names(0))
    for k in range(1, first + 1):
        below |= set(model.stage_names(k))
    return 0 if below & set(names) else first


def cache_layer(ctx, model, names: list[str], seqs, enabled: bool) -> int:
    """The block whose input is cached (0: no cache): the lowest trained block when it is above
    0, the model supports it and every rank's cache of ``seqs`` fits
    ``train.prefix_cache_mb`` (logged when it does not). Collective (one allreduce)."""
    t, topo = ctx.deck.train, ctx.topo
    first = first_trained_block(model, names) if t.prefix_cache_mb > 0 and enabled else 0
    need = PromptTask.nbytes(seqs, model.config.hidden_size, np.dtype(model.dtype).itemsize)
    ok = first > 0 and PromptTask.can_cache(model) and need <= t.prefix_cache_mb * 2**20
    agree = np.array([int(ok), int(first > 0 and PromptTask.can_cache(model))], np.int64)
    topo.allreduce(agree)
    if int(agree[0]) == topo.size:
        return first
    if int(agree[1]) == topo.size:
        log.info("finetune: no frozen-prefix cache: the states entering block %d would take "
                 "more than train.prefix_cache_mb = %g MiB on some rank (%.0f MiB on rank "
                 "%d): every step runs the whole model", first, t.prefix_cache_mb,
                 need / 2**20, topo.rank)
    return 0


def build_prompt_task(ctx, model, names: list[str], rows, train_idx, held_idx,
                      max_len: int, cache: bool = True) -> PromptTask:
    """The run's :class:`PromptTask`: prompts of the rank's texts, label words checked, and the
    frozen-prefix cache when ``cache``, the lowest trained block is above 0, the model supports
    it and every rank's cache fits ``train.prefix_cache_mb``. Collective (one allreduce)."""
    deck, t = ctx.deck, ctx.deck.train
    tok = Tokenizer.from_folder(deck.model.path or None, max_length=None)
    tok.tk.no_truncation()
    pr = deck.prompt
    word_ids = label_word_ids(tok, rows.label_names, pr.label_words, pr.template, deck.source)
    seqs = encode_prompts(tok, rows.texts, pr.template, max_len,
                          int(model.config.max_positions), deck.source)
    layer = cache_layer(ctx, model, names, seqs, cache)
    words = [tok.tk.decode([int(i)]) for i in word_ids]     # as text: ' good', not 'Ġgood'
    log.info("finetune: prompt task: template %r, label words %s for labels %s; prompts of "
             "at most %d tokens%s", pr.template,
             ", ".join(f"{w!r}" for w in words), ", ".join(rows.label_names), max_len,
             f"; blocks 0..{layer - 1} frozen: their output is computed once per prompt"
             if layer else "")
    return PromptTask(model, seqs, rows.labels, train_idx, held_idx, tok.pad_id,
                      t.eval_batch_size, word_ids, layer=layer, **store_args(ctx))

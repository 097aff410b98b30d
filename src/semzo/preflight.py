"""Every check a run makes before any work, in one place: the inputs the deck names (model
folders), the task against the model, the samples against what the later stages need (labels,
the held-out split, ``cluster.k``).

The driver (:mod:`semzo.pipeline`) runs :func:`check_inputs` once the deck is read; the embed
stage runs :func:`check_later_stages` as soon as it has read the corpus, before it loads the
encoder; a stage run alone runs its own checks (:func:`check_k`, :func:`check_samples`) on the
files it reads. Nothing here imports a stage: the stages import it.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .corpus.records import parse_stored
from .deck import Deck, DeckError
from .model import Tokenizer
from .model.chat import InstructTokenizer
from .model.config import read_config
from .model.loader import model_kind
from .model.zoo import NAMED, resolve_model_path
from .rng import philox_hash
from .runtime import AllRanksError, SemzoError, get_logger, raise_first, together

log = get_logger(__name__)


# ----------------------------------------------------------------------------- inputs
def check_inputs(d: Deck) -> None:
    """The model folders the deck's stages will read (``model.path``, ``embed.model``):
    checked when the deck is read, not when the stage that loads them starts after earlier
    stages wrote their files. DeckError naming the key."""
    if "embed" in d.run.stages:
        if d.model.path:
            check_model_path(d, d.model.path, "model.path")
        if d.embed.model:
            check_model_path(d, d.embed.model, "embed.model")
    elif "finetune" in d.run.stages and d.model.path:
        check_model_path(d, d.model.path, "model.path")


def check_model_path(d: Deck, path: str, key: str) -> None:
    """The model folder ``path`` (deck key ``key``): it exists, holds a config.json that semzo
    reads (a supported architecture with values it accepts). DeckError naming the key."""
    try:
        folder = resolve_model_path(path)
    except SemzoError as exc:
        raise DeckError(f"{d.source}: {key}: {exc}") from None
    if not folder.exists():
        named = ", ".join(sorted(NAMED))
        raise DeckError(f"{d.source}: {key}: no such folder {path} (semzo reads models from "
                        f"disk and downloads nothing: give a local folder of a Hugging Face "
                        f"model, a GGUF converted with `semzo convert gguf`, or a named model: "
                        f"{named})")
    if not folder.is_dir():
        raise DeckError(f"{d.source}: {key}: {path} is a file, not a model folder (a .gguf "
                        f"file: convert it with `semzo convert gguf {path} FOLDER`)")
    if not (folder / "config.json").is_file():
        raise DeckError(f"{d.source}: {key}: no config.json in folder {path}")
    # config.json is read now (not when the stage that loads the model starts, after earlier
    # stages wrote their files): unreadable, an unsupported architecture or bad values
    try:
        read_config(folder)
    except SemzoError as exc:
        raise DeckError(f"{d.source}: {key}: {exc}") from None


def embed_model_path(deck) -> tuple[str | None, str]:
    """(folder of the encoder that embeds the corpus, the deck key that named it): ``embed.model``
    if set, else ``model.path`` when that folder holds an encoder, else None (the packaged
    all-MiniLM-L6-v2). A decoder in ``[model]`` therefore still shards with MiniLM."""
    if deck.embed.model:
        return deck.embed.model, "embed.model"
    if deck.model.path:
        try:
            folder = resolve_model_path(deck.model.path)
            if read_config(folder).kind == "encoder":
                return deck.model.path, "model.path"
            return None, "embed.model"                  # a decoder: MiniLM shards
        except SemzoError as exc:       # unreadable or unsupported: say so before any work
            raise DeckError(f"{deck.source}: model.path: {exc}") from None
    return None, "embed.model"


# ----------------------------------------------------------------------------- samples
_DOMAIN_HELDOUT = 0x401D


def _split_u(ids: np.ndarray, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per sample id: a Philox hash of the id keyed by ``seed``
    (the same for any rank count or order)."""
    u = np.asarray(ids, np.int64).view(np.uint64)
    x0, _ = philox_hash(u & np.uint64(0xFFFFFFFF), u >> np.uint64(32), 0, _DOMAIN_HELDOUT, seed)
    return np.asarray(x0, np.float64) * 2.0 ** -32


def heldout_mask(ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True for held-out samples: a hash of the sample id, below ``fraction``."""
    return _split_u(ids, seed) < fraction


def validation_mask(ids: np.ndarray, seed: int, heldout: float, fraction: float) -> np.ndarray:
    """True for validation samples (``train.val_fraction``): the same hash as
    :func:`heldout_mask`, in ``[heldout, heldout + fraction)``, so the held-out samples do not
    change when a validation split is added, and the two never share a sample."""
    u = _split_u(ids, seed)
    return (u >= heldout) & (u < heldout + fraction)


def split_masks(deck, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This rank's (held-out, validation) masks of ``ids`` by the deck's ``[train]`` keys."""
    t = deck.train
    seed = t.split_seed if t.split_seed >= 0 else deck.run.seed
    return (heldout_mask(ids, seed, t.heldout_fraction),
            validation_mask(ids, seed, t.heldout_fraction, t.val_fraction))


def resolve_task(deck, model_kind: str) -> str:
    """``train.task`` with ``"auto"`` resolved for a model of ``model_kind`` ("lm" for a
    decoder, else "classify"); a task the model cannot run is an error on every rank."""
    task = deck.train.task
    kind = task if task != "auto" else ("lm" if model_kind == "decoder" else "classify")
    if kind in ("lm", "prompt", "sft", "choice") and model_kind != "decoder":
        raise AllRanksError(f"{deck.source}: train.task: {kind} fine-tuning needs a decoder "
                          f"in model.path, got an {model_kind}")
    return kind


def check_samples(deck, task_kind: str, ids: np.ndarray, labels: np.ndarray, n_classes: int,
                  allreduce, *, placed: bool = True) -> tuple[np.ndarray, np.ndarray, int,
                                                              int, int]:
    """What the finetune stage needs of its samples (this rank's ``ids`` and ``labels``, -1
    unlabeled; ``n_classes`` the same on every rank): labels on every sample and two classes
    for a classify or prompt task, and both sides of the held-out split non-empty (without
    held-out samples every evaluation would be nan and the run would still "succeed").
    Collective (``allreduce``: an in-place sum over the ranks); every rank raises together.
    The embed stage runs it too, on the corpus, when this run goes on to fine-tune.
    With ``train.val_fraction`` the validation split is counted out of training and must
    not be empty either. Returns this rank's held-out and validation masks and the numbers of
    training, held-out and validation samples over all ranks."""
    t = deck.train
    held, val = split_masks(deck, ids)
    train = ~held & ~val
    counts = np.array([int(train.sum()), int(held.sum()), int((labels < 0).sum()),
                       int(train.sum() == 0), 1, int(val.sum())], np.int64)
    allreduce(counts)
    # ranks with no training sample idle through every step: said once, before the work
    # (the embed stage: fewer training samples than ranks) and where it happens (finetune)
    idle = int(counts[4] - counts[0]) if placed is False else int(counts[3])
    if idle > 0:
        log.warning("%d of %d ranks %s no training sample (%d training samples in all): "
                    "they idle through every step; use fewer ranks or a larger corpus",
                    idle, int(counts[4]), "hold" if placed is not False else "will hold",
                    int(counts[0]))
    if task_kind in ("classify", "prompt") and (counts[2] or n_classes < 2):
        raise AllRanksError(f"{deck.corpus.path}: train.task = {task_kind} needs a label on "
                          f"every record and at least 2 classes ({int(counts[2])} "
                          f"unlabeled, {n_classes} classes); use a labelled corpus or "
                          f"task = \"lm\" with a decoder")
    if counts[0] == 0:
        raise AllRanksError(f"{deck.source}: train.heldout_fraction: no training samples left")
    if counts[1] == 0:
        raise AllRanksError(f"{deck.source}: train.heldout_fraction: no held-out samples "
                          f"({t.heldout_fraction:g} of {int(counts[0])} samples drew none); "
                          f"raise it or use a larger corpus")
    if t.val_fraction > 0 and counts[5] == 0:
        raise AllRanksError(f"{deck.source}: train.val_fraction: no validation samples "
                            f"({t.val_fraction:g} of {int(counts[0])} samples drew none); "
                            f"raise it or use a larger corpus")
    return held, val, int(counts[0]), int(counts[1]), int(counts[5])


def check_kept(deck, train_rows: np.ndarray, eval_rows: np.ndarray, held: np.ndarray,
               val: np.ndarray, allreduce) -> tuple[int, int, int]:
    """The numbers of training, held-out and validation samples over all ranks after a task
    left records out (``train.overlong = "skip"``: ``sft`` and ``choice``): :func:`check_samples`
    counted them before. ``eval_rows``: this rank's held-out and validation rows kept;
    ``held``/``val``: its masks over all rows. Collective; every rank raises together when a
    split is now empty (without training samples every rank would idle through the run,
    without held-out or validation ones every evaluation would be nan)."""
    counts = np.array([train_rows.size, int(held[eval_rows].sum()),
                       int(val[eval_rows].sum())], np.int64)
    allreduce(counts)
    t = deck.train
    splits = ["training"] + ["held-out"] + (["validation"] if t.val_fraction > 0 else [])
    empty = [name for name, c in zip(splits, counts) if c == 0]
    if empty:
        raise AllRanksError(f"{deck.source}: train.overlong = \"{t.overlong}\": no "
                            f"{' and no '.join(empty)} samples left once the records longer "
                            f"than train.max_length were left out ({int(counts[0])} training, "
                            f"{int(counts[1])} held-out, {int(counts[2])} validation); raise "
                            f"train.max_length or use a larger corpus")
    return int(counts[0]), int(counts[1]), int(counts[2])


def check_k(deck, n_total: int) -> None:
    """``cluster.k`` against the number of samples (the same on every rank): more clusters
    than samples is an error every rank raises together. The embed stage runs it too, on the
    corpus, when this run goes on to cluster."""
    if deck.cluster.k > n_total:
        raise AllRanksError(f"{deck.source}: cluster.k: {deck.cluster.k} clusters for only "
                            f"{n_total} samples")


def check_prompt(deck, label_names: list[str]) -> None:
    """``prompt.label_words`` against the model's tokenizer and the classes (one token per
    class, none shared), before any work. Every rank raises together."""
    tok = Tokenizer.from_folder(deck.model.path or None, max_length=None)
    label_word_ids(tok, label_names, deck.prompt.label_words, deck.prompt.template,
                   deck.source)


def check_later_stages(ctx, ids: np.ndarray, labels: np.ndarray,
                       label_names: list[str], records: list | None = None) -> None:
    """Before any embedding work, what the later stages of this run check of the samples:
    ``cluster.k`` against their number, the finetune stage's labels and held-out split (and
    that ``train.task`` suits the model). A deck those stages refuse then fails in seconds
    with their message, not after the corpus has been embedded. ``ids``, ``labels``: this
    rank's samples as they will be written; ``records``: for ``sft`` and ``choice`` corpora,
    ``(stored JSON, embedded text, line or row)`` of each (:func:`check_record_lengths`).
    Collective; every rank raises together."""
    deck, topo = ctx.deck, ctx.topo
    if "cluster" in deck.run.stages:
        n = np.array([len(ids)], np.int64)
        topo.allreduce(n)
        check_k(deck, int(n[0]))
    if "finetune" in deck.run.stages:
        task = resolve_task(deck, model_kind(deck.model.path or None))
        check_samples(deck, task, ids, labels, len(label_names), topo.allreduce, placed=False)
        if task == "prompt":
            check_prompt(deck, label_names)
        if records is not None and task in ("sft", "choice"):
            check_record_lengths(ctx, task, records)


def check_record_lengths(ctx, task: str, records: list) -> None:
    """With ``train.overlong = "error"``: the first record (in file order) whose completion
    (``sft``) or longest choice (``choice``) alone does not fit ``train.max_length`` tokens of
    the decoder's tokenizer (the prompt is cut from the left, see :mod:`semzo.model.chat`) is
    an error naming the corpus file and its line (row for Parquet), before any embedding; so
    is a record the tokenizer refuses (a chat template that fails on it). The decoder's
    tokenizer files are read whatever ``train.overlong``. Collective; every rank raises
    together."""
    deck, topo = ctx.deck, ctx.topo
    # the decoder's tokenizer files (eos_token_id, the chat template) are read now, before any
    # embedding, whatever train.overlong
    itok = together(topo.allreduce, InstructTokenizer.from_folder, deck.model.path)
    if deck.train.overlong != "error":
        return
    max_len = deck.train.max_length or deck.model.max_length
    fit = itok.sft if task == "sft" else itok.choice
    parquet = str(deck.corpus.path).endswith(".parquet")
    bad, refused = [], None
    for rec, _, line in records:
        try:
            if fit(parse_stored(rec), max_len) is None:
                bad.append((line, rec))
        except SemzoError as exc:          # a chat template that fails, a choice of no tokens
            if refused is None:
                where = f": row {line} (0-based)" if parquet else f":{line}"
                refused = (line, f"{deck.corpus.path}{where}: {exc}")
    raise_first(topo.allreduce, *(refused or (None, None)))
    first = np.array([bad[0][0] if bad else np.iinfo(np.int64).max], np.int64)
    topo.allreduce(first, op=MPI.MIN)
    if first[0] == np.iinfo(np.int64).max:
        return
    n = np.array([len(bad)], np.int64)
    topo.allreduce(n)
    where = f": row {int(first[0])} (0-based)" if parquet else f":{int(first[0])}"
    what = "completion" if task == "sft" else "longest choice"
    raise AllRanksError(f"{deck.corpus.path}{where}: the record's {what} alone does not fit "
                        f"train.max_length = {max_len} tokens of {deck.model.path} (prompts "
                        f"are cut from the left; {int(n[0])} such records): raise "
                        f"train.max_length or set train.overlong = \"skip\" to leave them out")



# ----------------------------------------------------------------------------- prompt
def encode_text(tok, text: str, special: bool) -> list[int]:
    """Token ids of ``text`` (``special``: with the tokenizer's special tokens)."""
    return list(tok.tk.encode(text, add_special_tokens=special).ids)


def default_label_words(label_names: list[str], template: str) -> list[str]:
    """Each label name, with a leading space unless the template ends in whitespace."""
    sep = "" if template[-1:].isspace() else " "
    return [sep + str(n) for n in label_names]


def label_word_ids(tok, label_names: list[str], words: tuple | list, template: str,
                   src: str) -> np.ndarray:
    """Token id (C,) int64 of each class's label word; errors (every rank) name
    ``prompt.label_words``: a count that differs from the classes, a word that is not exactly
    one token, two classes on the same token."""
    given = "" if words else " (default: the label names)"
    words = list(words) if words else default_label_words(label_names, template)
    if len(words) != len(label_names):
        raise AllRanksError(f"{src}: prompt.label_words: {len(words)} words for "
                          f"{len(label_names)} classes (labels in order: "
                          f"{', '.join(label_names)})")
    out = []
    for w, name in zip(words, label_names):
        ids = encode_text(tok, w, False)
        if len(ids) != 1:
            pieces = [tok.tk.decode([i]) for i in ids]          # ' class', not 'Ġclass'
            raise AllRanksError(f"{src}: prompt.label_words: {w!r} (label {name!r}){given} is "
                              f"{len(ids)} tokens {pieces}, not one; choose a word that is "
                              f"one token (with its leading space)")
        out.append(ids[0])
    if len(set(out)) != len(out):
        raise AllRanksError(f"{src}: prompt.label_words: two classes share a token ({words})")
    return np.array(out, np.int64)

"""What a resumed finetune must share with the checkpoint it continues from.

A checkpoint's seed history and deferred update regenerate z from the stream of ``zo.dist``
and ``run.seed``; its data cursors and the rows it trained on follow the held-out split
(``train.split_seed``, or ``run.seed`` when that is -1, ``train.heldout_fraction`` and
``train.val_fraction``). A
resume under other values would silently train on another stream, or on rows that were
held out before (and evaluate on rows it trained on), so each check here refuses the
mismatch with one line naming the key (exit 2). Every rank holds the same loaded
checkpoint, so every rank raises the same error.

Where a value comes from: ``model_meta`` (``"zo": {"dist"}``, ``"split": {"seed",
"heldout_fraction", "val_fraction"}``), the saved ``TrainState``'s ``run_seed``, and for checkpoints written
before a value was recorded the saved deck; neither there: nothing to compare.
"""

from __future__ import annotations

import json
import tomllib

from ..rng import NAMES, dist_code
from ..runtime import SemzoError

_HINT = ("resume with the deck it was written with (`semzo inspect` prints it), or train "
         "afresh into another run.output_dir")

#: the keys that define what a checkpoint's tensors mean: a resume under another value would
#: continue another task, another trainable set or another input encoding from them
TASK_KEYS = (
    ("model", "path"), ("model", "dtype"), ("model", "max_length"),
    ("train", "task"), ("train", "params"), ("train", "last_layers"), ("train", "lora_rank"),
    ("train", "lora_alpha"), ("train", "lora_targets"), ("train", "lora_layers"),
    ("train", "lora_a"),
    ("train", "max_length"), ("train", "head_init"), ("train", "head_scale"),
    ("prompt", "template"), ("prompt", "label_words"),
)
#: what a task key meant in checkpoints written before it existed, where it mattered (when
#: the same section's key had the value given): (that key, its value, the key's meaning)
BEFORE_KEY = {("train", "lora_a"): ("params", "lora", "train")}


def _deck_error(msg: str) -> SemzoError:
    err = SemzoError(msg)
    err.all_ranks = True
    return err


def dist_name(dist: str) -> str:
    """The canonical name of a z distribution ('normal' is 'gaussian')."""

    return NAMES[dist_code(dist)]


def _meta(loaded) -> dict:
    try:
        meta = json.loads(loaded.attrs.get("model_meta") or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _saved_deck(loaded) -> dict:
    """The checkpoint's deck as a dict ({} when absent or unreadable)."""

    text = loaded.deck_toml
    if not text.strip():
        return {}
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {}
    return d if isinstance(d, dict) else {}


def _section(d: dict, name: str) -> dict:
    s = d.get(name, {})
    return s if isinstance(s, dict) else {}


def check_same_dist(loaded, dist: str) -> None:
    """Refuse (one line naming ``zo.dist``, exit 2) a checkpoint written with another z
    distribution: its deferred update and its seed history regenerate z from that stream.
    Reads ``model_meta["zo"]["dist"]``, or for checkpoints written before it was recorded the
    saved deck's ``zo.dist``; neither there: nothing to compare."""
    zo = _meta(loaded).get("zo", {})
    saved = zo.get("dist") if isinstance(zo, dict) else None
    if saved is None:
        saved = _section(_saved_deck(loaded), "zo").get("dist")
    if saved is None:
        return
    try:
        saved = dist_name(saved)
    except ValueError:                           # a name this version does not know
        pass
    if saved != dist:
        raise _deck_error(f"{loaded.path}: zo.dist = {saved!r} in the checkpoint, "
                          f"{dist!r} in this deck; {_HINT}")


def split_meta(split_seed: int, heldout_fraction: float, val_fraction: float = 0.0) -> dict:
    """``model_meta["split"]``: how the held-out (and validation) rows were chosen."""
    return {"seed": int(split_seed), "heldout_fraction": float(heldout_fraction),
            "val_fraction": float(val_fraction)}


def _saved_val_fraction(loaded) -> float:
    """The checkpoint run's ``train.val_fraction``: ``model_meta["split"]``, else its deck's
    key, else 0 (written before validation splits existed)."""
    split = _meta(loaded).get("split")
    if isinstance(split, dict) and isinstance(split.get("val_fraction"), (int, float)):
        return float(split["val_fraction"])
    v = _section(_saved_deck(loaded), "train").get("val_fraction", 0.0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _saved_split(loaded, run_seed: int | None) -> tuple[int | None, float | None]:
    """(split seed, held-out fraction) the checkpoint's run used: ``model_meta["split"]``,
    else its deck's ``train.split_seed`` (-1 or absent: its ``run.seed``) and
    ``train.heldout_fraction``, else the saved run seed and nothing."""
    split = _meta(loaded).get("split")
    if isinstance(split, dict) and "seed" in split:
        frac = split.get("heldout_fraction")
        return int(split["seed"]), None if frac is None else float(frac)
    deck = _saved_deck(loaded)
    train, run = _section(deck, "train"), _section(deck, "run")
    seed = train.get("split_seed", -1)
    if not isinstance(seed, int) or seed < 0:
        seed = run.get("seed", run_seed)
    frac = train.get("heldout_fraction")
    return (None if seed is None else int(seed),
            float(frac) if isinstance(frac, (int, float)) else None)


def check_same_seeds(loaded, run_seed: int, split_seed: int, heldout_fraction: float,
                     val_fraction: float = 0.0) -> None:
    """Refuse (one line naming the key, exit 2) a checkpoint written under another
    ``run.seed`` (the z stream of every step and the data order derive from it), another
    held-out split seed (``train.split_seed``, or ``run.seed`` when it is -1), another
    ``train.heldout_fraction`` (either would move training rows into the held-out set) or
    another ``train.val_fraction`` (training rows into the validation set, or back)."""
    saved_run = loaded.state.get("run_seed")
    saved_run = None if saved_run is None else int(saved_run)
    if saved_run is not None and saved_run != int(run_seed):
        raise _deck_error(f"{loaded.path}: run.seed = {saved_run} in the checkpoint, "
                          f"{int(run_seed)} in this deck (it sets the z stream, the data order "
                          f"and the held-out split); {_HINT}")
    seed, frac = _saved_split(loaded, saved_run)
    if seed is not None and seed != int(split_seed):
        raise _deck_error(f"{loaded.path}: train.split_seed: the held-out split was drawn "
                          f"with seed {seed} in the checkpoint, {int(split_seed)} in this deck "
                          f"(train.split_seed, or run.seed when it is -1); {_HINT}")
    if frac is not None and frac != float(heldout_fraction):
        raise _deck_error(f"{loaded.path}: train.heldout_fraction = {frac:g} in the "
                          f"checkpoint, {float(heldout_fraction):g} in this deck (another "
                          f"held-out split); {_HINT}")
    vfrac = _saved_val_fraction(loaded)
    if vfrac != float(val_fraction):
        raise _deck_error(f"{loaded.path}: train.val_fraction = {vfrac:g} in the checkpoint, "
                          f"{float(val_fraction):g} in this deck (another validation split); "
                          f"{_HINT}")


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def check_same_task(loaded, deck) -> None:
    """Refuse (one line naming the key with both values, exit 2) a checkpoint whose deck gave
    a task-defining key (:data:`TASK_KEYS`: the task, the model, the trainable set, LoRA, the
    prompt template and label words, the lengths) another value than this deck. Keys absent
    from the checkpoint's deck (older versions) are not compared, except those whose value
    before they existed is known (:data:`BEFORE_KEY`)."""
    saved = _saved_deck(loaded)
    now = deck.to_dict()
    for section, key in TASK_KEYS:
        old = _section(saved, section)
        if key not in old:
            when, value, meant = BEFORE_KEY.get((section, key), (None, None, None))
            if when is None or old.get(when) != value:
                continue
            old = {key: meant}
        new = _plain(now.get(section, {}).get(key))
        if _plain(old[key]) != new:
            raise _deck_error(f"{loaded.path}: {section}.{key} = {old[key]!r} in the checkpoint, "
                              f"{new!r} in this deck; {_HINT}")


def check_lr_auto(loaded, lr) -> None:
    """Refuse (one line naming ``zo.lr``, exit 2) a resume under ``zo.lr = "auto"`` of a
    checkpoint whose run had a fixed lr: a resumed run never scans (the lr is the
    checkpoint's ``base_lr``), so it would go on at the fixed lr under lr auto's schedule and
    guards. Reads the checkpoint's deck; nothing to compare when it has none."""
    saved = _section(_saved_deck(loaded), "zo").get("lr")
    if lr == "auto" and saved is not None and saved != "auto":
        raise _deck_error(f"{loaded.path}: zo.lr = {saved!r} in the checkpoint, \"auto\" in "
                          f"this deck (a resumed run does not scan: it would keep the "
                          f"checkpoint's lr); {_HINT}")


def check_same_estimator(loaded, estimator: str, directions: int) -> None:
    """Refuse (one line naming ``zo.estimator`` or ``zo.directions``, exit 2) a checkpoint
    written with another gradient estimator or another number of fzoo directions: its seed
    history and deferred state belong to that estimator's step. Reads
    ``model_meta["zo"]["estimator"]`` (checkpoints written before it was recorded: mezo)."""
    zo = _meta(loaded).get("zo", {})
    zo = zo if isinstance(zo, dict) else {}
    saved = zo.get("estimator", "mezo")
    if saved != estimator:
        raise _deck_error(f"{loaded.path}: zo.estimator = {saved!r} in the checkpoint, "
                          f"{estimator!r} in this deck; {_HINT}")
    nd = zo.get("directions")
    if estimator == "fzoo" and nd is not None and int(nd) != int(directions):
        raise _deck_error(f"{loaded.path}: zo.directions = {int(nd)} in the checkpoint, "
                          f"{int(directions)} in this deck; {_HINT}")

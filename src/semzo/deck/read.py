"""Reading a deck: TOML (``tomllib``) plus ``--set`` overrides, each value checked against the
schema (:mod:`.sections`), then the rules that involve several keys.

Errors are :class:`DeckError` (exit code 2) with one line: ``DECK: section.key: what is wrong``
(``DECK: --set section.key: ...`` for a key a ``--set`` gave). Relative paths in a deck are
resolved against the directory the job is launched from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from pathlib import Path
from typing import Any

from .sections import SECTIONS, Deck, DeckError


def _suggest(name: str, options: Any) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(t: Any) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false",
            "str": "a string", "tuple": "a list of strings"}[t]


def _check_value(src: str, path: str, f: dataclasses.Field, value: Any) -> Any:
    """Type-check and range-check one value; return it in its canonical Python type."""
    want = f.type if isinstance(f.type, str) else f.type.__name__
    meta = f.metadata

    def bad(msg: str) -> DeckError:
        return DeckError(f"{src}: {path}: {msg}")

    if meta["kind"] == "rank_weights":
        if isinstance(value, str):
            if value not in ("equal", "measured"):
                raise bad(f"expected \"equal\", \"measured\" or a list of positive numbers, "
                          f"got {value!r}")
            return value
        if not isinstance(value, list) or not value:
            raise bad(f"expected \"equal\", \"measured\" or a list of positive numbers, got "
                      f"{type(value).__name__} {value!r}")
        for x in value:
            if (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                    or x <= 0):
                raise bad(f"every weight must be a positive finite number, got {x!r}")
        return tuple(float(x) for x in value)
    if meta["kind"] in ("float_or_auto", "int_or_auto") and isinstance(value, str):
        if value != "auto":
            what = "a number" if meta["kind"] == "float_or_auto" else "an integer"
            raise bad(f"expected {what} or \"auto\", got {value!r}")
        return value
    if want == "float" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, float), "bool": isinstance(value, bool),
          "str": isinstance(value, str),
          "tuple": isinstance(value, list) and all(isinstance(x, str) for x in value)}[want]
    if not ok:
        raise bad(f"expected {_type_name(want)}, got {type(value).__name__} {value!r}")
    if want == "tuple":
        value = tuple(value)
    if want == "float" and not math.isfinite(value):
        raise bad(f"must be a finite number, got {value}")
    lo, hi = meta["min"], meta["max"]
    if lo is not None and (value < lo or (meta["min_excl"] and value == lo)):
        raise bad(f"must be {'>' if meta['min_excl'] else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad(f"must be <= {hi}, got {value}")
    choices = meta["choices"]
    if choices is not None:
        items = value if want == "tuple" else [value]
        for item in items:
            if item not in choices:
                raise bad(f"'{item}' is not one of {', '.join(map(str, choices))}"
                          + _suggest(item, choices))
        if want == "tuple":
            what = "stage" if meta["kind"] == "stages" else "value"
            if not items:
                raise bad(f"must name at least one {what}")
            if len(set(items)) != len(items):
                raise bad(f"a {what} is listed twice")
            order = [choices.index(x) for x in items]
            if meta["kind"] == "stages" and order != sorted(order):
                raise bad(f"stages must be in pipeline order: {', '.join(choices)}")
            value = tuple(items)
    if meta["kind"] == "outdir" and not value:
        raise bad("must not be empty")
    return value


def parse_override(src: str, text: str) -> tuple[str, str, Any]:
    """Parse one ``--set section.key=value``; the value is read as TOML, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise DeckError(f"{src}: --set {text}: expected section.key=value")
    path, raw = text.split("=", 1)
    section, name = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, name, value


def build(raw: dict[str, Any], src: str, overrides: list[str] = (), *,
          check_inputs: bool = True) -> Deck:
    """Validate a raw TOML mapping plus ``--set`` overrides into a :class:`Deck`."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    from_set: set[tuple[str, str]] = set()      # keys a --set gave: errors name the option
    for text in overrides:
        section, name, value = parse_override(src, text)
        from_set.add((section, name))
        if section not in SECTIONS:
            raise DeckError(f"{src}: --set {section}: unknown section"
                            + _suggest(section, SECTIONS))
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise DeckError(f"{src}: {section}: expected a table")
        raw[section][name] = value
    for name, table in raw.items():
        if name not in SECTIONS:
            raise DeckError(f"{src}: {name}: unknown section" + _suggest(name, SECTIONS))
        if not isinstance(table, dict):
            raise DeckError(f"{src}: {name}: expected a table [{name}], "
                            f"got {type(table).__name__}")
    sections = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        where = {k: f"--set {name}.{k}" if (name, k) in from_set else f"{name}.{k}"
                 for k in table}
        for k, v in table.items():
            if k not in fields:
                raise DeckError(f"{src}: {where[k]}: unknown key" + _suggest(k, fields))
            if isinstance(v, dict):
                raise DeckError(f"{src}: {where[k]}: unexpected table")
        values = {k: _check_value(src, where[k], fields[k], v) for k, v in table.items()}
        sections[name] = cls(**values)
    deck = Deck(source=src, **sections)
    _check_consistency(deck, check_inputs)
    return deck


#: [train] keys that only the named train.params values read
PARAMS_KEYS = {"last_layers": ("head+last",), "lora_rank": ("lora",), "lora_alpha": ("lora",),
               "lora_layers": ("lora",), "lora_targets": ("lora",), "lora_a": ("lora",)}


def label_rows_mode(d: Deck) -> str:
    """``train.label_rows`` resolved: ``auto`` is ``exact`` for the prompt task with
    ``zo.lr = "auto"`` (the defaults of new decks), ``frozen`` otherwise."""
    if d.train.label_rows != "auto":
        return d.train.label_rows
    return "exact" if d.train.task == "prompt" and d.zo.lr == "auto" else "frozen"


def auto_rows_warmup(steps: int) -> int:
    """``train.label_rows_warmup = "auto"`` for a run of ``steps`` steps: 5 % of them, at
    least 1 and at most 50 (each costs one forward pass, a fifth of an fzoo step's)."""
    return min(50, max(1, round(0.05 * steps))) if steps > 0 else 0


def label_rows_warmup(d: Deck, steps: int) -> int:
    """``train.label_rows_warmup`` resolved for a run of ``steps`` steps: the steps at the
    start that train the label rows alone; 0 unless the rows train (``exact``)."""
    if label_rows_mode(d) != "exact":
        return 0
    v = d.train.label_rows_warmup
    return auto_rows_warmup(steps) if v == "auto" else min(int(v), max(steps, 0))


def unread_keys(d: Deck) -> list[str]:
    """The [train] keys of the trainable set that hold a value other than their default while
    train.params does not read them (``inputs/demo.toml``'s ``last_layers = 0`` under
    ``--set train.params=lora``): one message each, for the finetune stage to log. Not an
    error, since a deck file and the ``--set`` options on top of it are layered, but never
    ignored silently."""
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING
                         else f.default_factory())
                for f in dataclasses.fields(type(d.train))}
    out = []
    for k, applies in PARAMS_KEYS.items():
        v = getattr(d.train, k)
        if d.train.params not in applies and v != defaults[k]:
            want = " or ".join(f'"{a}"' for a in applies)
            out.append(f"{d.source}: train.{k} = {v!r} is not read: it applies to "
                       f"train.params = {want}, and train.params is \"{d.train.params}\"")
    if d.train.label_rows_lr != defaults["label_rows_lr"] and label_rows_mode(d) != "exact":
        out.append(f"{d.source}: train.label_rows_lr = {d.train.label_rows_lr!r} is not read: "
                   f"the label rows train only with train.label_rows = \"exact\" (\"auto\" "
                   f"with the prompt task and zo.lr = \"auto\")")
    return out


def _check_consistency(d: Deck, check_inputs: bool = True) -> None:
    """Rules that involve several keys."""
    if d.model.dtype == "float16" and d.run.device == "cpu":
        raise DeckError(f"{d.source}: model.dtype: float16 weights need run.device = \"gpu\" "
                        f"(bfloat16 runs on the CPU)")
    if d.model.matmul == "bfloat16" and d.model.dtype != "bfloat16":
        raise DeckError(f"{d.source}: model.matmul: \"bfloat16\" multiplies bfloat16 weights "
                        f"and needs model.dtype = \"bfloat16\", got {d.model.dtype!r}")
    if d.zo.offload == "host" and d.zo.schedule != "streamed":
        raise DeckError(f"{d.source}: zo.offload: \"host\" streams stages and needs "
                        f"zo.schedule = \"streamed\", got {d.zo.schedule!r}")
    if d.train.lora_a != "train" and d.train.params != "lora":
        raise DeckError(f"{d.source}: train.lora_a: \"{d.train.lora_a}\" freezes the A "
                        f"matrices of LoRA adapters; train.params is \"{d.train.params}\" "
                        f"(set train.params = \"lora\" or remove train.lora_a)")
    if d.train.label_rows == "exact" and d.train.task != "prompt":
        raise DeckError(f"{d.source}: train.label_rows: \"exact\" trains the label words' "
                        f"rows of the prompt task; train.task is \"{d.train.task}\" (set "
                        f"train.task = \"prompt\" or train.label_rows = \"auto\")")
    if d.train.label_rows_warmup not in ("auto", 0) and label_rows_mode(d) != "exact":
        raise DeckError(f"{d.source}: train.label_rows_warmup: {d.train.label_rows_warmup} "
                        f"steps train the label rows alone, but they do not train here "
                        f"(train.label_rows resolves to \"{label_rows_mode(d)}\"; set "
                        f"train.label_rows = \"exact\" with train.task = \"prompt\", or "
                        f"remove train.label_rows_warmup)")
    if d.train.val_fraction > 0:
        if d.train.eval_every <= 0:
            raise DeckError(f"{d.source}: train.val_fraction: a validation split is read by "
                            f"the periodic evaluations (train.eval_every > 0), got "
                            f"train.eval_every = {d.train.eval_every}")
        if d.train.heldout_fraction + d.train.val_fraction >= 1.0:
            raise DeckError(f"{d.source}: train.val_fraction: {d.train.val_fraction:g} with "
                            f"train.heldout_fraction = {d.train.heldout_fraction:g} leaves no "
                            f"training samples")
    if d.zo.lr_rollback != "auto" and float(d.zo.lr_rollback) > 0:
        if d.train.eval_every <= 0:
            raise DeckError(f"{d.source}: zo.lr_rollback: the held-out guard needs periodic "
                            f"evaluations (train.eval_every > 0), got train.eval_every = "
                            f"{d.train.eval_every}")
        if d.zo.offload == "host":
            raise DeckError(f"{d.source}: zo.lr_rollback: not with zo.offload = \"host\" "
                            f"(set it to 0 or \"auto\")")
    # inputs are checked only when a stage that reads them runs (so `semzo topology` works
    # without a corpus); defaults are checked too, not only the keys the deck sets
    # (the model folders are the preflight's: semzo.preflight.check_inputs)
    # (a deck with experiment.decks reads no corpus: its task decks' are checked as they load)
    if check_inputs and "embed" in d.run.stages and not d.experiment.decks and \
            not Path(d.corpus.path).is_file():
        raise DeckError(f"{d.source}: corpus.path: file not found: {d.corpus.path}")
    if "{text}" not in d.prompt.template:
        raise DeckError(f"{d.source}: prompt.template: must contain {{text}} (where each text "
                        f"goes), got {d.prompt.template!r}")
    if len(set(d.prompt.label_words)) != len(d.prompt.label_words):
        raise DeckError(f"{d.source}: prompt.label_words: a word is listed twice")
    if len(set(d.corpus.labels)) != len(d.corpus.labels):
        raise DeckError(f"{d.source}: corpus.labels: a label is listed twice")
    stems = [Path(p).stem for p in d.experiment.decks]
    if len(set(stems)) != len(stems):
        raise DeckError(f"{d.source}: experiment.decks: two decks have the same file name "
                        f"({', '.join(d.experiment.decks)}): each task's folder is named by it")
    for p in d.experiment.decks if check_inputs else ():
        if not Path(p).is_file():
            raise DeckError(f"{d.source}: experiment.decks: deck file not found: {p}")


def check_world(d: Deck, size: int) -> None:
    """Rules that depend on the number of ranks (a simulated hierarchy must divide it)."""
    rpn, nps = d.topology.ranks_per_node, d.topology.nodes_per_switch
    rw = d.place.rank_weights
    if isinstance(rw, tuple) and len(rw) != size:
        raise DeckError(f"{d.source}: place.rank_weights: {len(rw)} weights for {size} ranks "
                        f"(one per rank, or \"equal\" / \"measured\")")
    if rpn > 0:
        if size % rpn:
            raise DeckError(f"{d.source}: topology.ranks_per_node: {size} ranks cannot be split "
                            f"into nodes of {rpn} ranks")
        if nps > 0 and (size // rpn) % nps:
            raise DeckError(f"{d.source}: topology.nodes_per_switch: {size // rpn} nodes cannot "
                            f"be split into switches of {nps} nodes")


def load(path: str | Path | None, overrides: list[str] = (), *,
         check_inputs: bool = True) -> Deck:
    """Read and validate a deck file (``None``: defaults only). Raises :class:`DeckError`."""
    if path is None:
        return build({}, "<defaults>", overrides, check_inputs=check_inputs)
    src = str(path)
    p = Path(path)
    if not p.is_file():
        raise DeckError(f"{src}: deck file not found")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DeckError(f"{src}: not UTF-8 text ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise DeckError(f"{src}: TOML syntax error: {exc}") from None
    return build(raw, src, overrides, check_inputs=check_inputs)


def from_toml_text(text: str, src: str = "<stored deck>") -> Deck:
    """Rebuild a deck from the resolved TOML stored in an output file (no file checks)."""
    raw = tomllib.loads(text)
    for name, cls in SECTIONS.items():
        if name in raw:
            fields = {f.name: f for f in dataclasses.fields(cls)}
            raw[name] = {k: v for k, v in raw[name].items() if k in fields}
    # stored decks are validated when written; skip file-existence checks on reload
    sections = {}
    for name, cls in SECTIONS.items():
        t = raw.get(name, {})
        sections[name] = cls(**{k: (tuple(v) if isinstance(v, list) else v)
                                for k, v in t.items()})
    return Deck(source=src, **sections)



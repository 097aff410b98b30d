"""`semzo experiment` over several task decks (``experiment.decks``): one experiment per deck.

A deck with ``experiment.decks`` is not a task itself: it names task decks (complete decks:
``inputs/llm.toml``, ``inputs/sft.toml``) and says what every task shares. Each task deck runs
as the experiment of :mod:`.runner`, in ``run.output_dir``/<deck file stem>/, with

* the experiment deck's ``[experiment]`` table (shardings, modes, seeds, report points, target)
  in place of the task deck's, and
* every key the experiment deck sets in another table put over the task deck's value: the keys
  written in its file, and any key whose value differs from its default (a ``--set``);
  ``zo.lr = "auto"`` and ``train.steps`` there give every task one step-size rule and one
  forward-pass budget. (A ``--set`` to a key's default value cannot be told from no setting:
  write it in the deck file instead.)

Then rank 0 writes ``run.output_dir``/report.md, an index of the tasks (each task's conclusion,
its report and its wall time). ``--resume`` and ``--report-only`` apply to every task.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
import tomllib
from pathlib import Path

from mpi4py import MPI

from ..deck import SECTIONS, Deck, DeckError
from ..pipeline import load_deck_collective
from ..runtime import SemzoError, get_logger
from ..tomlw import _toml_value
from .report import write_index, write_report

log = get_logger(__name__)

#: tables whose keys the experiment deck never passes on (its own, and where it writes)
OWN = {("run", "output_dir")}


def shared_keys(deck: Deck) -> list[tuple[str, str, object]]:
    """The keys the experiment deck ``deck`` passes on to every task deck: (section, key,
    value) of the keys written in its file (``deck.source``, when readable) and of those whose
    value differs from the default, outside ``[experiment]`` and ``run.output_dir``."""
    written: set[tuple[str, str]] = set()
    try:
        raw = tomllib.loads(Path(deck.source).read_text(encoding="utf-8"))
        written = {(s, k) for s, t in raw.items() if isinstance(t, dict) for k in t}
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        pass
    out = []
    for name, cls in SECTIONS.items():
        if name == "experiment":
            continue
        section, default = getattr(deck, name), cls()
        for f in dataclasses.fields(cls):
            if (name, f.name) in OWN:
                continue
            v = getattr(section, f.name)
            if (name, f.name) in written or v != getattr(default, f.name):
                out.append((name, f.name, v))
    return out


def task_decks(deck: Deck, comm: MPI.Intracomm, deck_error) -> list[Deck]:
    """The task decks of ``deck`` as they run: loaded and checked on every rank (one error,
    exit 2, naming the task deck and the key, if any rank finds one), each also by
    ``deck_error`` (:func:`.runner.deck_error`). Collective."""
    base = Path(deck.run.output_dir)
    shared = [f"{s}.{k}={_toml_value(list(v) if isinstance(v, tuple) else v)}"
              for s, k, v in shared_keys(deck)]
    out = []
    for path in deck.experiment.decks:
        stem = Path(path).stem
        sets = [*shared, f"run.output_dir={_toml_value(str(base / stem))}"]
        try:
            sub = load_deck_collective(path, sets, comm)
        except DeckError as exc:
            raise DeckError(f"{exc} (task deck of {deck.source}: experiment.decks)") from None
        if sub.experiment.decks:
            raise DeckError(f"{deck.source}: experiment.decks: {path} names task decks of its "
                            f"own (experiment.decks); a task deck must be a single task")
        sub = sub.replace(experiment=dataclasses.replace(deck.experiment, decks=()))
        msg = deck_error(sub)                # every task is checked before any runs
        if msg:
            raise DeckError(f"{msg} (task deck of {deck.source}: experiment.decks)")
        out.append(sub)
    return out


def run_tasks(deck: Deck, comm: MPI.Intracomm, resume: bool, run_experiment,
              deck_error) -> Path:
    """Every task deck's experiment (``run_experiment``: :func:`.runner.run_experiment`, each
    deck checked by ``deck_error`` first), then the index report. Collective. Returns its
    path."""
    t0 = time.perf_counter()
    subs = task_decks(deck, comm, deck_error)
    if comm.Get_rank() == 0:
        base = Path(deck.run.output_dir)
        base.mkdir(parents=True, exist_ok=True)
        cmd = f"mpirun -n {comm.Get_size()} python -m semzo {shlex.join(sys.argv[1:])}"
        if os.environ.get("SEMZO_COMMAND"):            # set by `make experiment-llm`
            cmd = f"{os.environ['SEMZO_COMMAND']}  # = {cmd}"
        (base / "experiment-tasks.toml").write_text(f"# command: {cmd}\n{deck.to_toml()}",
                                                    encoding="utf-8")
    log.info("semzo experiment: %d tasks (%s), each in %s/<deck>/", len(subs),
             ", ".join(f"{Path(p).stem}: train.task = {s.train.task}"
                       for p, s in zip(deck.experiment.decks, subs)), deck.run.output_dir)
    walls = {}
    for path, sub in zip(deck.experiment.decks, subs):
        t1 = time.perf_counter()
        run_experiment(sub, comm, resume=resume)
        walls[Path(path).stem] = time.perf_counter() - t1
    return index_report(deck, comm, walls, time.perf_counter() - t0)


def index_report(deck: Deck, comm: MPI.Intracomm, walls: dict[str, float] | None = None,
                 total: float | None = None) -> Path:
    """Rank 0 writes ``run.output_dir``/report.md from the tasks' folders (each task's report
    is rebuilt first when ``walls`` is None: ``--report-only``); one error on every rank if
    a task's files are missing. Collective."""
    base = Path(deck.run.output_dir)
    err, path = None, None
    if comm.Get_rank() == 0:
        try:
            if walls is None:
                for p in deck.experiment.decks:
                    write_report(base / Path(p).stem)
            path = write_index(base, [Path(p).stem for p in deck.experiment.decks], walls,
                               total)
        except FileNotFoundError as exc:
            err = (f"{deck.source}: run.output_dir: {exc.filename or exc}: not found (run "
                   f"`semzo experiment` without --report-only first)")
    err, path = comm.bcast((err, path), root=0)
    if err:
        e = SemzoError(err)
        e.all_ranks = True
        raise e
    return path

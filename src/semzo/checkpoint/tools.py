"""``semzo inspect CKPT`` and ``semzo export CKPT OUTDIR``.

Both run on any number of ranks (one is enough): reading and verifying is collective, rank 0
prints or writes. Every file is checked whole (rank 0, :mod:`.filesum`) before HDF5 opens
it: a damaged file is one line and exit 2, never a hang or a crash. ``inspect`` of a folder lists its checkpoints (verifying each) and then
describes the newest valid one.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..deck import from_toml_text
from ..model import export_hf, load_model
from ..model import label_rows as head_rows
from ..model.gguf_export import GGUF_TYPES, export_gguf
from ..model.storage import same_storage_copy
from ..model.zoo import NAMED, resolve_model_path
from ..preflight import default_label_words
from ..runtime import AllRanksError, SemzoError, get_logger
from . import modelfile
from .format import CheckpointError, manifest_checksum
from .manager import find_model_checkpoint, list_checkpoints, read_latest
from .reader import describe, load, verify

log = get_logger(__name__)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _damaged(exc) -> SemzoError:
    """One line, exit 2, the same on every rank."""
    e = SemzoError(f"damaged checkpoint: {exc}")
    e.all_ranks = True
    return e


def _deck_dtype(deck_toml) -> str:
    """model.dtype of a stored deck ("float32" when absent or unreadable)."""
    try:
        return str(tomllib.loads(str(deck_toml or "")).get("model", {}).get("dtype", "float32"))
    except (tomllib.TOMLDecodeError, AttributeError):
        return "float32"


def summary(path: str | Path, comm: MPI.Intracomm, *, deck: bool = True) -> tuple[str, bool]:
    """(text, True) describing a checkpoint file or folder. Collective. A damaged file
    (its whole-file record or a checksum does not match) raises :class:`SemzoError` on every
    rank (exit 2, one line); a folder lists every checkpoint with its verdict and describes
    the newest valid one, or returns (listing, False) when none is valid."""
    path = Path(path)
    if not path.exists():
        raise SemzoError(f"{path}: no such checkpoint file or folder")
    if modelfile.is_model_file(path):
        try:
            return modelfile.summary(path, comm, deck=deck), True
        except CheckpointError as exc:
            raise _damaged(exc) from None
    lines: list[str] = []
    if path.is_dir():
        ckpts = list(reversed(list_checkpoints(path)))
        latest = read_latest(path)
        lines.append(f"checkpoint folder {path}: {len(ckpts)} checkpoint(s), latest -> "
                     f"{latest or '(none)'}")
        chosen = None
        for step, p in ckpts:
            ok, why = verify(p, comm)
            lines.append(f"  {p.name}  step {step:>9}  {_mib(p.stat().st_size):>12}  "
                         f"{'OK' if ok else 'INVALID: ' + why}")
            if ok and chosen is None:
                chosen = p
        if chosen is None:
            return "\n".join(lines + ["no valid checkpoint"]), False
        text, ok = summary(chosen, comm, deck=deck)
        return "\n".join(lines + ["", text]), ok
    try:
        meta = describe(path, comm)
    except CheckpointError as exc:
        raise _damaged(exc) from None
    ok, why = verify(path, comm)
    if not ok:
        raise _damaged(why)
    a = meta.attrs
    topo = json.loads(a.get("topology", "{}") or "{}")
    where = f"{a.get('world_size')} ranks"
    if "n_nodes" in topo:
        where += f" ({topo['n_nodes']} nodes, {topo['n_switches']} switches)"
    lines.append(f"checkpoint {path}")
    lines.append(f"  step {a.get('step')}, written {a.get('created', '?')} by semzo "
                 f"{a.get('semzo_version')} on {where}, format {a.get('format_version')}")
    metrics = meta.groups.get("metrics", {})
    if metrics:
        lines.append("  metrics: " + ", ".join(f"{k} = {_value(v)}" for k, v in metrics.items()))
    params = [d for d in meta.datasets if d[0].startswith("params/")]
    n_values = sum(int(np.prod(d[1])) for d in params)
    bf16 = _deck_dtype(a.get("semzo_deck")) == "bfloat16"
    lines.append(f"  parameters: {len(params)} tensors, {n_values:,} values, "
                 f"{_mib(int(a.get('param_bytes', 0)))}; file {_mib(meta.file_bytes)}"
                 + ("; model.dtype bfloat16: uint16 tensors (u2) are bfloat16 bits"
                    if bf16 else ""))
    for g, label in (("state", "state"), ("per_rank", "per-rank (P, ...)"),
                     ("extras", "extras")):
        items = [f"{p.split('/', 1)[1]} {tuple(s)} {t}" for p, s, t, _ in meta.datasets
                 if p.startswith(g + "/")]
        if g == "state":
            scalars = []
            for gp, d in meta.groups.items():
                if gp == "state" or gp.startswith("state/"):
                    pre = gp[len("state/"):] + "/" if "/" in gp else ""
                    scalars += [f"{pre}{k}={_value(v)}" for k, v in d.items()
                                if k != "semzo_keys"]
            items = scalars + items
        if items:
            lines.append(f"  {label}: " + ", ".join(items))
    if a.get("shards_path"):
        sp = Path(a["shards_path"])
        now = manifest_checksum(sp) if sp.is_file() else "missing"
        lines.append(f"  shards: {sp} {a.get('shards_manifest')} "
                     f"({'matches' if now == a.get('shards_manifest') else 'now ' + now})")
    whole = "whole file OK, " if meta.version >= 2 else "no whole-file record (format 1), "
    lines.append(f"  checksums: {whole}{a.get('checksum_kind')} of {meta.blocks} blocks"
                 f"{' in packed datasets' if meta.version >= 2 else ''}, metadata "
                 f"{a.get('attrs_checksum')}: OK")
    big = sorted(params, key=lambda d: -int(np.prod(d[1])))[:5]
    for p, s, t, where in big:
        lines.append(f"    {p[7:]:<56} {tuple(s)!s:<14} {t:<4} {where}")
    if len(params) > len(big):
        lines.append(f"    ... and {len(params) - len(big)} more tensors")
    if deck and a.get("semzo_deck"):
        lines.append("  deck:")
        lines.extend("    " + ln for ln in str(a["semzo_deck"]).rstrip().splitlines())
    return "\n".join(lines), ok


def checkpoint_dtype(deck, asked: str | None, where) -> str:
    """The weight storage to rebuild a checkpoint's model with on the CPU: bfloat16 when its
    deck trained bfloat16 weights (the bits are restored as they are), else float32 (float16
    weights convert exactly). ``asked`` (a --dtype) must agree: SemzoError naming it."""
    stored = deck.model.dtype if deck is not None else "float32"
    dt = "bfloat16" if stored == "bfloat16" else "float32"
    if asked is not None and asked != dt:
        raise SemzoError(f"--dtype {asked}: {where} holds {stored} weights, rebuilt as {dt} "
                         f"(omit --dtype)")
    return dt


def rebuild_model(loaded, meta: dict):
    """The base model of the stored deck with the checkpoint's head and LoRA adapters."""
    deck = from_toml_text(loaded.deck_toml) if loaded.deck_toml.strip() else None
    folder = deck.model.path if deck is not None and deck.model.path else None
    model = load_model(folder, dtype=checkpoint_dtype(deck, None, loaded.path))
    names = set(loaded.params)
    if "classifier.weight" in names and model.head is None:
        head = meta.get("head", {})
        n = int(loaded.params["classifier.weight"].shape[0])
        model.add_classifier(int(head.get("n_classes", n)),
                             normalize=bool(head.get("normalize", False)))
    lora_a = sorted(n for n in names if n.endswith(".lora_A.weight"))
    if lora_a:
        lm = meta.get("lora", {})
        train = getattr(deck, "train", None)
        alpha = lm.get("alpha", getattr(train, "lora_alpha", None))
        if alpha is None:
            raise SemzoError(f"{loaded.path}: LoRA tensors but no LoRA alpha in model_meta "
                             f"or the stored deck")
        rank = int(loaded.params[lora_a[0]].shape[0])
        modules = tuple(n[:-len(".lora_A.weight")] for n in lora_a)
        model.add_lora(rank=rank, alpha=float(alpha), targets=modules)
    return model


def take_label_rows(loaded):
    """The trained label rows of a model.h5 (its ``label_rows.*`` datasets, taken out of
    ``loaded.params``) or of a checkpoint (its state): (word ids, delta (C, E)) or None.
    Apply them with :func:`semzo.model.label_rows.apply_to_model` once the tensors are in."""
    got = head_rows.take_from(loaded.params, str(loaded.path))
    return got if got is not None else head_rows.from_state(loaded.state, str(loaded.path))


EXPORT_INFO = "semzo_export.json"


def _export_info(path: Path, loaded, meta: dict, dtype: str) -> dict:
    """What an exported folder needs beside the weights to reproduce the run's model: where
    it came from (file, step), the task, and for the prompt task the template and the label
    word of each class (the defaults resolved), from the stored deck."""
    info = {"source": str(path), "step": int(loaded.step), "task": meta.get("task"),
            "dtype": dtype}
    head = meta.get("head") or {}
    if head.get("label_names"):
        info["label_names"] = list(head["label_names"])
    deck = from_toml_text(loaded.deck_toml) if loaded.deck_toml.strip() else None
    if deck is not None and meta.get("task") == "prompt":
        names = _stored_label_names(loaded, meta)
        words = list(deck.prompt.label_words) or default_label_words(names, deck.prompt.template)
        info["prompt"] = {"template": deck.prompt.template, "label_names": names,
                          "label_words": words}
    if deck is not None:
        info["deck"] = loaded.deck_toml
    return info


def _stored_label_names(loaded, meta: dict) -> list[str]:
    """The class names in order: ``model_meta`` (checkpoints), else model.h5's attribute."""
    names = meta.get("label_names") or (meta.get("head") or {}).get("label_names")
    if names is None:
        names = np.atleast_1d(loaded.attrs.get("label_names", []))
    return [x.decode() if isinstance(x, bytes) else str(x) for x in names]


def _export_gguf_model(path: Path, out: Path, comm: MPI.Intracomm, gguf_type: str,
                       report: dict | None) -> Path:
    """``semzo export MODEL OUT.gguf --format gguf`` of a model folder or named model (no
    checkpoint): rank 0 loads and writes it."""
    err = None
    if comm.Get_rank() == 0:
        try:
            model = load_model(resolve_model_path(path))
            export_gguf(model, out, gguf_type=gguf_type)
        except (SemzoError, OSError, ValueError) as exc:
            err = str(exc) if isinstance(exc, SemzoError) else f"{out}: {exc}"
    err = comm.bcast(err, root=0)
    if err:
        raise SemzoError(err)
    if report is not None:
        report.update(step=None, dtype=gguf_type)
    return out


def export(path: str | Path, outdir: str | Path, comm: MPI.Intracomm, *, force: bool = False,
           dtype: str | None = None, report: dict | None = None, format: str = "hf",
           gguf_type: str = "f32") -> Path:
    """Write the checkpoint's (or model.h5's) model as a Hugging Face folder (rank 0), with
    ``semzo_export.json`` (:func:`_export_info`). An existing non-empty ``outdir`` is refused
    unless ``force``; ``dtype``: the weights' dtype (None: the stored one). ``report`` (a
    dict) receives the step and the dtype written. Collective: the file is read and verified
    by every rank. Raises :class:`SemzoError` on every rank on error.

    ``format="gguf"``: ``outdir`` is the GGUF file to write (llama / gemma3,
    :func:`semzo.model.gguf_export.export_gguf`, LoRA merged, ``gguf_type`` f32, f16, bf16
    or q8_0); ``path`` may then also be a model folder or a named model ("smollm2")."""
    path = Path(path)
    out = Path(outdir)
    if format not in ("hf", "gguf"):
        raise AllRanksError(f"--format {format!r}: choose hf or gguf")
    if format == "gguf":
        if gguf_type not in GGUF_TYPES:
            raise AllRanksError(f"--gguf-type {gguf_type!r}: choose one of "
                                f"{', '.join(GGUF_TYPES)}")
        if out.is_dir():
            raise AllRanksError(f"{out}: is a folder; --format gguf writes a file "
                                f"(e.g. {out / 'model.gguf'})")
        if out.exists() and not force:
            raise AllRanksError(f"{out}: exists; pass --force to overwrite it")
        if not out.resolve().parent.is_dir():
            raise AllRanksError(f"{out}: folder {out.resolve().parent} does not exist")
        if str(path) in NAMED or (path.is_dir() and (path / "config.json").is_file()):
            return _export_gguf_model(path, out, comm, gguf_type, report)
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise AllRanksError(f"{out}: exists and is not an empty folder; pass --force to "
                            f"overwrite it")
    if path.is_dir():
        found, which = find_model_checkpoint(path, comm)
        if found is None:
            raise _damaged(f"{path}: no valid checkpoint in this folder")
        if comm.Get_rank() == 0:
            log.info("export: %s (the %s checkpoint of %s)", found.name,
                     "best held-out" if which == "best" else "newest", path)
        path = found
    try:
        loaded = modelfile.read(path, comm) if modelfile.is_model_file(path) else load(path, comm)
    except CheckpointError as exc:
        raise _damaged(exc) from None
    err = None
    if comm.Get_rank() == 0:
        try:
            meta = json.loads(loaded.attrs.get("model_meta") or "{}")
            rows = take_label_rows(loaded)
            model = rebuild_model(loaded, meta)
            missing = [n for n in loaded.params if n not in model.params]
            if missing:
                raise SemzoError(f"{path}: tensor {missing[0]!r} is not in the model "
                                 f"({len(missing)} unknown)")
            for name, arr in loaded.params.items():
                dst = model.params[name]
                if dst.shape != arr.shape:
                    raise SemzoError(f"{path}: {name} has shape {arr.shape}, the model "
                                     f"{dst.shape}")
                # in place: the model's fused buffers stay valid; bfloat16 bits are copied
                # as they are, never cast to or from a float array
                same_storage_copy(dst, arr, f"{path}: {name}")
            if rows is not None:
                head_rows.apply_to_model(model, *rows, str(path))
            kept = len(model.params) - len(loaded.params)
            if kept:
                log.info("%d tensors not in the checkpoint keep the base model's values", kept)
            if format == "gguf":
                export_gguf(model, out, gguf_type=gguf_type)
            else:
                dt = dtype or model.storage
                export_hf(model, out, dtype=dt,
                          label_names=(meta.get("head") or {}).get("label_names") or None)
                info = _export_info(path, loaded, meta, dt)
                (out / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n",
                                               encoding="utf-8")
        except (SemzoError, OSError, ValueError) as exc:
            err = str(exc) if isinstance(exc, SemzoError) else f"{out}: {exc}"
    err = comm.bcast(err, root=0)
    if err:
        raise SemzoError(err)
    if report is not None:
        report.update(step=int(loaded.step), dtype=gguf_type if format == "gguf" else
                      dtype or _deck_dtype(loaded.deck_toml))
    return out

"""The finetune stage: ``shards.h5`` -> ZO fine-tuning -> ``model.h5``, ``metrics.csv``, plots.

Every rank holds a full replica of the model and trains on its own shard (the place stage's
rows); ranks exchange only scalars (see engine.py). Tasks: ``classify`` (encoder or decoder with
a classification head on the shard labels; the head starts from scaled class means of the
training embeddings) and ``lm`` (next-token loss of a decoder on the shard texts).

``model.h5``: one dataset per saved tensor under its Hugging Face name (global shape, written
collectively in row blocks), attrs: the resolved deck, ``model_source``, ``task``,
``trainable`` (JSON list of trained names), ``lora`` (JSON), ``label_names``, ``head_normalize``,
``steps``, ``skips``, ``weight_storage`` (model.dtype: with "bfloat16" the tensors are uint16
datasets of bfloat16 bits, :mod:`semzo.model.storage`), held-out loss/accuracy before and after.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from ..checkpoint import Checkpointer, CheckpointError, list_checkpoints
from ..deck.read import label_rows_mode, unread_keys
from ..energy import summary as energy_summary
from ..h5check import SHARD_KEYS, agree, deck_drift
from ..h5io import create_collective, row_range, string_array, write_slab
from ..model import Tokenizer, gemm_cpu, load_model
from ..model.storage import BF16, storage_name
from ..model.zoo import folder_checksum
from ..preflight import check_kept, check_samples, resolve_task
from ..runtime import SemzoError, get_logger
from ..tasks.choice import build_choice_task
from ..tasks.classify import (
    ClassifyTask,
    FeatureClassifyTask,
    PrefixCachedClassifyTask,
    features_in_shards,
    head_features,
    init_head_class_means,
)
from ..tasks.lm import build_lm_task
from ..tasks.prompt import build_prompt_task
from ..tasks.sft import build_sft_task
from ..zo.engine import ZOEngine
from ..zo.offload import HostStore
from ..zo.perturb import ztensors
from . import label_rows as lr_rows
from .data import Batcher, local_batch, read_shard
from .loop import (
    LoopConfig,
    Preempted,
    StopRequest,
    TrainState,
    evaluate,
    perplexity,
    schedule_name,
    train,
)
from .report import Metrics, energy_meter, metered
from .resume import (
    check_lr_auto,
    check_same_dist,
    check_same_estimator,
    check_same_seeds,
    check_same_task,
    dist_name,
    split_meta,
)
from .trainable import first_trained_block, select_trainable

log = get_logger(__name__)


def _deck_error(msg: str) -> SemzoError:
    err = SemzoError(msg)
    err.all_ranks = True
    return err


def _log_cpu_bf16(comm) -> None:
    """Collective (one allgather). Say how the CPU ranks compute ``model.matmul =
    "bfloat16"`` (:func:`semzo.model.gemm_cpu.kind`): AMX tiles, the CPU's bfloat16 dot
    products, or the same arithmetic emulated in float32 (no AVX512_BF16, or
    ``SEMZO_CPU_BF16_DOT=0``); they sum in different orders, so a run whose ranks differ is
    said to."""
    kinds = comm.allgather(gemm_cpu.kind())
    size = comm.Get_size()
    if len(set(kinds)) == 1:
        log.info("finetune: model.matmul = \"bfloat16\": %s (semzo.model.gemm_cpu)",
                 gemm_cpu.KINDS[kinds[0]])
    else:
        log.warning("finetune: model.matmul = \"bfloat16\": the ranks compute it differently "
                    "(%s); the ways sum in different orders, so the run's numbers depend on "
                    "which nodes it got",
                    "; ".join(f"{kinds.count(k)} of {size} ranks: {gemm_cpu.KINDS[k]}"
                              for k in gemm_cpu.KINDS if k in kinds))


def run_finetune_stage(ctx) -> dict:
    """Collective. Reads shards.h5, fine-tunes, writes model.h5, metrics.csv and plots.
    Returns the stage's headline figures (held-out accuracy before/after, steps, speed)."""

    deck, topo = ctx.deck, ctx.topo
    comm = topo.world
    t, z = deck.train, deck.zo
    shards = ctx.path("shards.h5")
    found = comm.allreduce(int(shards.is_file()))
    if found != comm.Get_size():
        raise _deck_error(f"{deck.source}: run.stages: {shards} not found (run the place stage "
                          f"first)")
    model_path = deck.model.path or None
    # zo.offload = "host": the parameters stay in host memory from the start (a model larger
    # than the GPU never has to fit there), and every forward outside the ZO step streams the
    # stages, so the shortcuts that run the frozen lower layers once before training (prefix
    # caches, head features by a forward pass) are off; the simulated device follows the rule
    offload = z.offload == "host"
    model = load_model(model_path, xp=ctx.xp, dtype=deck.model.dtype,
                       host_params=offload and deck.run.device == "gpu")
    try:
        model.set_matmul(deck.model.matmul)
    except ValueError as exc:
        raise _deck_error(f"{deck.source}: {exc}") from None
    if deck.model.matmul == "bfloat16" and ctx.xp is np:
        _log_cpu_bf16(comm)
    task_kind = resolve_task(deck, model.kind)
    use_emb = task_kind == "classify" and t.head_init == "class_means"
    rows = read_shard(shards, comm, with_embeddings=task_kind == "classify")
    agree(comm, deck_drift(shards, rows.deck_toml, deck, SHARD_KEYS,
                           "rerun the place stage (run.stages) or set the key back"))
    n_classes = len(rows.label_names)
    # train.val_fraction: a validation split out of training; the tasks are built with the
    # held-out and the validation rows as evaluation rows, then set the validation ones apart
    held, val, n_train, n_held, n_val = check_samples(deck, task_kind, rows.ids, rows.labels,
                                                      n_classes, topo.allreduce)
    validation = t.val_fraction > 0
    if task_kind == "classify":
        model.add_classifier(n_classes, init="zeros" if use_emb else "normal",
                             seed=deck.run.seed, normalize=True)
    names = select_trainable(model, t.params, t.last_layers, t.lora_rank, t.lora_alpha,
                             deck.run.seed, targets=t.lora_targets, src=deck.source,
                             lora_layers=t.lora_layers, lora_a=t.lora_a)
    # train.lora_a = "frozen": the A matrices do not train but define the model with B, so
    # checkpoints, best.h5 and model.h5 keep them too (a resume puts them back as stored)
    fixed = [sp.a for sp in model.lora.values() if sp.a in model.frozen]
    if task_kind == "classify" and use_emb:
        train_rows = ~held & ~val
        init_head_class_means(model, rows.embeddings[train_rows], rows.labels[train_rows],
                              n_classes, t.head_scale, topo)
    max_len = t.max_length or deck.model.max_length
    train_idx, held_idx = np.flatnonzero(~held & ~val), np.flatnonzero(held | val)
    head_only = task_kind == "classify" and all(n.startswith("classifier.") for n in names)
    if task_kind == "prompt":
        task = build_prompt_task(ctx, model, names, rows, train_idx, held_idx, max_len,
                                 cache=not offload)
    elif task_kind in ("sft", "choice"):
        if task_kind == "sft":
            task = build_sft_task(ctx, model, names, rows, train_idx, held_idx, max_len,
                                  cache=not offload, is_val=val)
        else:
            task = build_choice_task(ctx, model, names, rows, train_idx, held_idx, max_len,
                                     cache=not offload)
        train_idx, held_idx = task.train_rows, task.heldout_rows    # overlong ones left out
        n_train, n_held, n_val = check_kept(deck, train_idx, held_idx, held, val,
                                            topo.allreduce)
        if offload and task_kind == "sft":
            task.topo = None           # greedy generation needs the resident model
            if t.gen_samples and topo.rank == 0:
                log.warning("finetune: train.gen_samples = %d: no greedy generations are "
                            "scored with zo.offload = \"host\" (generation needs the "
                            "resident model); the completion loss and token accuracy still are",
                            t.gen_samples)
    elif head_only and (not offload or features_in_shards(ctx, model, rows, max_len)):
        feats, how = head_features(ctx, model, rows, max_len, t.eval_batch_size)
        log.info("finetune: only the head trains: the frozen encoder's pooled features are "
                 "computed once (%s) and every ZO step evaluates the head on them", how)
        task = FeatureClassifyTask(model, feats, rows.labels, train_idx, held_idx,
                                   t.eval_batch_size)
    elif task_kind == "lm":
        task = build_lm_task(ctx, model, names, rows, train_idx, held_idx, max_len,
                             cache=not offload)
    else:
        tok = Tokenizer.from_folder(model_path, max_length=max_len)
        seqs = tok.encode_batch(rows.texts)
        first = first_trained_block(model, names, t, task_kind)
        need = PrefixCachedClassifyTask.nbytes(seqs, model.config.hidden_size,
                                               np.dtype(model.dtype).itemsize)
        fits = np.array([need <= t.prefix_cache_mb * 2**20], np.int64)
        topo.allreduce(fits)                       # every rank takes the same path
        if first > 0 and int(fits[0]) == topo.size and not offload:
            task = PrefixCachedClassifyTask(model, seqs, rows.labels, train_idx, held_idx,
                                            tok.pad_id, t.eval_batch_size, first)
            log.info("finetune: blocks 0..%d and the embeddings are frozen: their output is "
                     "computed once per text and kept (%.0f MiB on rank 0); each step runs "
                     "blocks %d..%d", first - 1, need / 2**20, first,
                     model.config.num_layers - 1)
        else:
            if first > 0 and offload:
                log.info("finetune: zo.offload = \"host\": no frozen-prefix cache, every step "
                         "streams the whole model")
            elif first > 0:
                log.info("finetune: the frozen blocks' output would take more than "
                         "train.prefix_cache_mb = %g MiB on some rank: every step runs the "
                         "whole model", t.prefix_cache_mb)
            task = ClassifyTask(model, seqs, rows.labels, train_idx, held_idx, tok.pad_id,
                                t.eval_batch_size)

    if validation:
        task.split_eval(val)
    steps = t.steps
    if t.max_epochs > 0:
        per_epoch = n_train / (topo.size * t.batch_size)
        steps = min(steps, max(1, math.ceil(t.max_epochs * per_epoch)))
    ck, state, resumed_from, before = _open_checkpoints(ctx, model, names, task_kind, n_classes,
                                                train_idx.size, rows.label_names, fixed)
    _label_rows(ctx, model, task, state, resumed_from is not None and ck.last_path)
    engine = ZOEngine(ztensors([(n, model.params[n]) for n in names]), topo, mode=z.mode,
                      eps=z.eps, weight_decay=z.weight_decay,
                      dist=z.dist_name, restore=z.restore, run_seed=deck.run.seed,
                      schedule=z.schedule, cache_z=z.cache_z, estimator=z.estimator_name,
                      directions=z.directions)
    if offload:
        engine.store = HostStore(model, task, engine, device=deck.run.device)
        log.info("finetune: zo.offload = \"host\": parameters in host memory, %d stages "
                 "streamed to the %s one at a time%s", task.stage_count(),
                 "GPU" if deck.run.device == "gpu" else "simulated device",
                 "" if deck.run.device == "gpu" else " (testing: no memory saved)")
    n_tr = engine.n_trainable
    n_all = model.num_parameters(include_frozen=True)
    log.info("finetune: task %s, %s model, trainable %s: %d tensors, %d of %d parameters "
             "(%.2f%%); %d training / %d held-out%s samples; mode %s (%d seed group%s), "
             "batch %d per rank, max_length %d, %d steps, lr %s (%s), eps %.1e, z %s, "
             "estimator %s",
             task_kind, model.kind, t.params if t.params != "head+last"
             else f"head+last:{t.last_layers}", len(names), n_tr, n_all,
             100.0 * n_tr / max(n_all, 1), n_train, n_held,
             f" / {n_val} validation" if validation else "", z.mode, engine.n_groups,
             "s" if engine.n_groups > 1 else "", t.batch_size, max_len, steps,
             z.lr if z.lr == "auto" else f"{z.lr:.2e}", schedule_name(deck), z.eps, z.dist_name,
             z.estimator_name if z.estimator_name == "mezo" else
             f"fzoo ({engine.n_directions} directions per step)")
    if task.kind == "prompt" and getattr(task, "label_rows", None) is not None:
        log.info("finetune: train.label_rows = \"exact\": the %d label words' rows of the LM "
                 "head (%d parameters) train by their exact gradient beside the ZO step "
                 "(Adam, step %g x their RMS %.4g, the ZO schedule's decay)",
                 len(task.word_ids), task.label_rows.m.size, t.label_rows_lr,
                 task.label_rows.rms)
    for msg in unread_keys(deck) if topo.rank == 0 else ():
        log.warning("finetune: %s", msg)

    # a resumed run keeps the rows of metrics.csv up to its checkpoint and the held-out
    # figures from before fine-tuning that the checkpoint recorded (not those at the resume)
    metrics = Metrics(ctx.outdir, active=topo.rank == 0, keep_until=resumed_from)
    meter = energy_meter(ctx, metrics)
    add_row = metered(metrics.add, meter)
    # what the held-out count counts
    unit = {"lm": "tokens", "sft": "completion tokens"}.get(task_kind, "samples")
    val_before = None
    if before is None:
        before = evaluate(task, topo, engine.store)
        if resumed_from is None:
            val_before = _validate(task, topo, engine, validation, state.step)
            add_row({"kind": "eval", "step": state.step, "heldout_loss": before[0],
                     "heldout_acc": before[1], "heldout_n": before[2],
                     **perplexity(task, before[0]), **_val_row(val_before)})
        log.info("held-out before fine-tuning%s: loss %.4f, accuracy %.4f (%d " + unit + ")",
                 (" (ZERO-SHOT, the prompt alone)" if task_kind in ("prompt", "choice") else "")
                 if resumed_from is None else f" (at the resumed step {resumed_from})", *before)
    else:
        log.info("held-out before fine-tuning%s, recorded in the checkpoint: loss %.4f, "
                 "accuracy %.4f (%d " + unit + ")",
                 " (ZERO-SHOT, the prompt alone)" if task_kind in ("prompt", "choice") else "",
                 *before)
    gen_before = _log_generations(task, topo, "before fine-tuning")
    batch = local_batch(deck, topo, rows.rank_weights)
    batcher = Batcher(train_idx.size, batch, deck.run.seed, topo.rank)

    def add_comm(s: float) -> None:
        ctx.timer.comm_time["finetune"] = ctx.timer.comm_time.get("finetune", 0.0) + s

    t0, first_step = time.perf_counter(), state.step
    cfg = LoopConfig.from_deck(deck, steps)
    saver = _StepSaver(ck, model, names, train_idx.size, centroids=_centroids(ctx), topo=topo,
                       fixed=fixed, flush=engine.flush, before=before, rows=metrics,
                       keep_best=t.eval_every > 0, by="loss" if task_kind == "lm" else "acc",
                       sync=engine.verify if engine.fused_groups else None)
    if state.step == 0:                          # the model before training is a candidate
        _candidate(saver, state, before, val_before or _validate(task, topo, engine,
                                                                 validation, state.step))
    on_rollback = None
    if cfg.rollback and saver.keep_best:
        def on_rollback(st: TrainState) -> None:
            saver.rollback(st, engine)
        log.info("finetune: held-out guard on (zo.lr_rollback %g): a held-out loss %g %% above "
                 "the lowest so far puts the best held-out model back and halves the lr",
                 cfg.rollback, 100 * cfg.rollback)
    with StopRequest(topo.world) as stop:       # SIGUSR1 / SIGTERM: checkpoint, then stop
        state = train(engine, task, batcher, state, cfg, on_row=saver.on_row(add_row),
                      on_comm=add_comm, on_step=saver, on_eval=saver.on_eval,
                      on_rollback=on_rollback, stop=stop)
    secs = time.perf_counter() - t0
    saver.final(state)
    if stop.signum:
        saver.close()

        raise Preempted(f"finetune: {signal.Signals(stop.signum).name} received: stopped after "
                        f"step {state.step} of {steps}, checkpoint {ck.last_path} written; "
                        f"the same command with --resume continues")
    after = evaluate(task, topo, engine.store)
    val_after = _validate(task, topo, engine, validation, state.step)
    used = meter.read()
    metrics.add({"kind": "eval", "step": state.step, "heldout_loss": after[0],
                 "heldout_acc": after[1], "heldout_n": after[2],
                 "elapsed_s": time.perf_counter() - t0, "forwards": state.forwards,
                 **perplexity(task, after[0]), **used.row(), **_val_row(val_after)})
    meter.close()
    _candidate(saver, state, after, val_after)
    saver.close()
    if t.save != "none":
        save_model(ctx, model, names, t.save, task_kind, rows.label_names, state, before, after,
                   meta=ck.model_meta, fixed=fixed)
    metrics.finish(f"({task_kind}, {z.mode}, {topo.size} ranks)")   # renamed once it all worked
    gen_after = _log_generations(task, topo, "after fine-tuning")
    what = {"lm": "next-token accuracy", "sft": "completion-token accuracy"}.get(task_kind,
                                                                              "accuracy")
    ran = state.step - first_step
    log.info("finetune: %d steps in %.1f s (%.2f steps/s), %d skipped", ran, secs,
             ran / max(secs, 1e-9), state.skips)
    _log_device_memory(ctx, topo, engine, model)
    if used.joules is None:
        log.info("finetune: energy not measured (no readable RAPL/NVML); %.1f CPU "
                 "core-seconds (all ranks)", used.core_s)
    else:
        log.info("finetune: energy %.1f J (%s); %.1f CPU core-seconds (all ranks)",
                 used.joules, meter.describe(), used.core_s)
    log.info("HELD-OUT %s before %.4f -> after %.4f (%+.2f points); loss %.4f -> %.4f "
             "(%d " + unit + ")", what.upper(), before[1], after[1], 100 * (after[1] - before[1]),
             before[0], after[0], after[2])
    if gen_before and gen_after:
        log.info("HELD-OUT GENERATIONS exact match %.4f -> %.4f, token F1 %.4f -> %.4f "
                 "(%d greedy generations)", gen_before[0], gen_after[0], gen_before[1],
                 gen_after[1], gen_after[2])
    out = {"task": task_kind, "steps": state.step, "skipped": state.skips,
           "steps/s": ran / max(secs, 1e-9), "heldout acc before": float(before[1]),
           "heldout acc after": float(after[1]), "heldout loss before": float(before[0]),
           "heldout loss after": float(after[0]),
           "lr": float(state.base_lr) if state.base_lr >= 0 else math.nan,   # nan: no ZO step
           "forward passes": int(state.forwards)}
    if task_kind == "lm" and math.isfinite(after[0]):
        out["heldout ppl after"] = math.exp(min(after[0], 700.0))
    out.update(energy_summary(used, meter))
    out.update(_summary_best(state, before, after, task_kind, t.eval_every > 0, ck,
                             topo.rank == 0, validation))
    if resumed_from is not None:
        out["resumed from step"] = resumed_from
    files = [p for p in ("model.h5", "metrics.csv", "loss.png", "accuracy.png")
             if p != "model.h5" or t.save != "none"]
    where = ctx.outdir
    log.info("finetune: wrote %s in %s%s", ", ".join(files), where,
             f"; checkpoints in {ck.dir}" if deck.checkpoint.every_steps else "")
    if t.save != "none":
        log.info("next: `semzo export %s OUTDIR` writes a Hugging Face folder%s; `semzo inspect "
                 "%s` describes it", where / "model.h5",
                 f", `semzo generate {where / 'model.h5'} --prompt TEXT` runs it"
                 if model.kind == "decoder" else "", where / "model.h5")
    return out


def _label_rows(ctx, model, task, state, resumed) -> None:
    """``train.label_rows``: give the prompt task its trained label rows (fresh, or the
    resumed checkpoint's, checked: a resume under the other value or other label words is
    refused in one line on every rank)."""
    deck = ctx.deck
    exact = label_rows_mode(deck) == "exact" and getattr(task, "kind", "") == "prompt"
    have = state.label_rows.size > 0
    if resumed and have != exact:
        raise _deck_error(f"{resumed}: written with train.label_rows = "
                          f"\"{'exact' if have else 'frozen'}\", this run's is "
                          f"\"{'exact' if exact else 'frozen'}\"; resume with the deck it was "
                          f"written with (`semzo inspect` prints it) or set "
                          f"checkpoint.resume = \"never\"")
    if not exact:
        return
    task.label_rows = lr_rows.LabelRows.of_model(model, task.word_ids,
                                                 deck.train.label_rows_lr)
    if not have:
        state.label_rows = task.label_rows.pack()
        state.label_row_ids = task.word_ids.copy()
        return
    if not np.array_equal(state.label_row_ids, task.word_ids):
        raise _deck_error(f"{resumed}: its trained label rows belong to the token ids "
                          f"{state.label_row_ids.tolist()}, this run's label words are "
                          f"{task.word_ids.tolist()}; resume with the deck it was written "
                          f"with or set checkpoint.resume = \"never\"")
    try:
        task.label_rows.unpack(state.label_rows, str(resumed))
    except SemzoError as exc:
        raise _deck_error(str(exc)) from None


def _log_generations(task, topo, when: str):
    """The sft task's last generation metrics (exact match, F1, count) and, on rank 0, three
    of its held-out prompts with their reference and greedy generation; None for other
    tasks."""
    got = getattr(task, "last_gen", None)
    if got is None:
        return None
    if topo.rank == 0:
        for i, (prompt, ref, gen) in enumerate(task.examples[:3]):
            log.info("generation %d %s:\n  prompt:    %s\n  reference: %s\n  generated: %s",
                     i + 1, when, _clip(prompt), _clip(ref), _clip(gen))
    return got


def _clip(s: str, n: int = 160) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n - 3] + "..."


def _validate(task, topo, engine, validation: bool, step: int):
    """The validation split's (loss, accuracy, count) with ``train.val_fraction``, else None.
    Collective."""
    if not validation:
        return None
    got = evaluate(task, topo, engine.store, "val")
    log.info("validation at step %d: loss %.4f, accuracy %.4f (%d)", step, *got)
    return got


def _val_row(val) -> dict:
    return {} if val is None else {"val_loss": val[0], "val_acc": val[1], "val_n": val[2]}


def _candidate(saver, state, test, val) -> None:
    """The model before or after training as a candidate for the best one: by its held-out
    figures ``test``, or with a validation split by its validation figures ``val``."""
    if val is None:
        saver.on_eval(state, test[0], test[1])
    else:
        saver.on_eval(state, val[0], val[1], test=(test[0], test[1]))


def _summary_best(state: TrainState, before, after, task_kind: str, evals: bool, ck,
                  speak: bool = True, validation: bool = False) -> dict:
    """The final and the best held-out metric and their steps (logged, and for the stage's
    summary), and a warning when the final model is worse than the one before training.
    With a validation split the best model is the best on it, and its held-out figure is
    reported beside its validation figure."""
    lm = task_kind == "lm"
    name = "loss" if lm else "accuracy"
    fin = float(after[0] if lm else after[1])
    zero = float(before[0] if lm else before[1])
    out = {f"final heldout {'loss' if lm else 'acc'}": fin, "final step": state.step}
    if evals and state.best_step >= 0 and validation:
        best = state.best_test_loss if lm else state.best_test_acc
        vbest = state.best_loss if lm else state.best_acc
        log.info("held-out %s: final %.4f (step %d); the best model on the validation split "
                 "(step %d, validation %s %.4f, kept as %s): held-out %.4f", name, fin,
                 state.step, state.best_step, name, vbest, ck.dir / "best.h5", best)
        out[f"best heldout {'loss' if lm else 'acc'}"] = float(best)
        out[f"best validation {'loss' if lm else 'acc'}"] = float(vbest)
        out["best step"] = state.best_step
    elif evals and state.best_step >= 0:
        best = state.best_loss if lm else state.best_acc
        log.info("held-out %s: final %.4f (step %d), best %.4f (step %d, kept as %s)", name,
                 fin, state.step, best, state.best_step, ck.dir / "best.h5")
        out[f"best heldout {'loss' if lm else 'acc'}"] = float(best)
        out["best step"] = state.best_step
    worse = fin > zero if lm else fin < zero
    if worse and math.isfinite(fin) and math.isfinite(zero):
        out["warning"] = "final model worse than before training"
    if worse and math.isfinite(fin) and math.isfinite(zero) and speak:
        log.warning("finetune: the final model is WORSE than before training on the held-out "
                    "set (%s %.4f -> %.4f)%s", name, zero, fin,
                    f"; the best held-out model (step {state.best_step}) is "
                    f"{ck.dir / 'best.h5'}, which `semzo export` and `semzo generate` take "
                    f"from the run folder" if evals and state.best_step >= 0 else
                    "; set train.eval_every to keep the best held-out model")
        out["warning"] = "final model worse than before training"
    return out


def _log_device_memory(ctx, topo, engine, model) -> None:
    """One line on the device memory the run held, the largest rank's (collective): on a GPU
    the high-water mark of CuPy's memory pool (the pool keeps freed blocks, so this bounds the
    peak from above), the parameters held there, and with ``zo.offload = "host"`` the stage
    slots (stage 0, the last stage, two blocks); on the CPU with offload, the simulated
    device's slots."""

    store = engine.store
    slots = store.device_bytes() if getattr(store, "offloads", False) else 0
    gpu = ctx.xp is not np
    pool = int(ctx.xp.get_default_memory_pool().total_bytes()) if gpu else 0
    params = sum(int(a.nbytes) for a in model.params.values() if not isinstance(a, np.ndarray))
    buf = np.array([pool, params, slots], np.int64)
    topo.allreduce(buf, op=MPI.MAX)
    mib = 2.0 ** 20
    if gpu:
        log.info("finetune: device memory (largest rank): pool high-water %.1f MiB, "
                 "parameters resident %.1f MiB%s", buf[0] / mib, buf[1] / mib,
                 f", offload stage slots {buf[2] / mib:.1f} MiB" if buf[2] else "")
    elif buf[2]:
        log.info("finetune: simulated device (zo.offload = \"host\" on the CPU): stage slots "
                 "%.1f MiB (largest rank)", buf[2] / mib)


# ----------------------------------------------------------------------------- checkpoints
def cursor_error(path, rank: int, cur: np.ndarray, n_local: int) -> str | None:
    """None when a checkpoint's data cursor ``[epoch, position, ...]`` can resume a shard of
    ``n_local`` training rows, else the one-line error."""
    ok = cur.size >= 2 and cur.dtype.kind in "iu" and int(cur[0]) >= 0 and \
        0 <= int(cur[1]) < max(n_local, 1)
    return None if ok else (f"{path}: per_rank/cursor of rank {rank} is {cur.tolist()}: not "
                            f"[epoch >= 0, position in [0, {max(n_local, 1)})]")


def _open_checkpoints(ctx, model, names: list[str], task_kind: str, n_classes: int,
                      n_train_local: int, label_names: list[str] = (), fixed: list[str] = ()):
    """The run's :class:`~semzo.checkpoint.Checkpointer` and the starting
    :class:`TrainState`: fresh, or from the newest valid checkpoint (``checkpoint.resume =
    "auto"``), whose trainable tensors (and the ``fixed`` ones stored beside them: frozen
    LoRA A matrices) are then copied into the model in place. Collective.
    Returns ``(ck, state, resumed step or None, the held-out (loss, accuracy, count) before
    fine-tuning that the checkpoint recorded, or None)``."""

    deck, topo = ctx.deck, ctx.topo
    meta: dict = {"task": task_kind, "trainable": names,
                  "label_names": [str(x) for x in label_names]}
    if model.source is not None:               # what `semzo generate CKPT` checks
        digest = folder_checksum(model.source) if topo.rank == 0 else None
        meta["model_folder"] = str(Path(model.source).resolve())
        meta["model_checksum"] = topo.world.bcast(digest, root=0)
    if model.head:
        meta["head"] = {"n_classes": n_classes, "normalize": bool(model.head.normalize),
                        "label_names": [str(x) for x in label_names]}
    if model.lora:
        meta["lora"] = {"rank": deck.train.lora_rank, "alpha": deck.train.lora_alpha,
                        "targets": sorted(model.lora)}
    meta["zo"] = {"dist": dist_name(deck.zo.dist_name),   # the z stream the state refers to
                  "estimator": deck.zo.estimator_name, "directions": deck.zo.directions}
    t = deck.train                                        # the held-out split it trained beside
    split_seed = t.split_seed if t.split_seed >= 0 else deck.run.seed
    meta["split"] = split_meta(split_seed, t.heldout_fraction, t.val_fraction)
    ck = Checkpointer(topo, deck.checkpoint, deck.run.output_dir, deck.to_toml(),
                      shards_path=ctx.path("shards.h5"), model_meta=meta)
    state = TrainState(run_seed=deck.run.seed)
    if deck.checkpoint.resume == "never":
        if topo.rank == 0 and list_checkpoints(ck.dir):
            log.warning("finetune: %s holds checkpoints of an earlier run; starting from the "
                        "model (checkpoint.resume = \"never\"; pass --resume to continue "
                        "from them). Newer ones of the earlier run stay until pruned.", ck.dir)
        return ck, state, None, None
    loaded = ck.resume(shard_size=n_train_local)
    if loaded is None:
        log.info("finetune: no valid checkpoint in %s: starting from the model", ck.dir)
        return ck, state, None, None
    check_lr_auto(loaded, deck.zo.lr)        # first: zo.lr decides the estimator and z "auto"
    check_same_dist(loaded, meta["zo"]["dist"])
    check_same_task(loaded, deck)
    check_same_estimator(loaded, deck.zo.estimator_name, deck.zo.directions)
    check_same_seeds(loaded, deck.run.seed, split_seed, t.heldout_fraction, t.val_fraction)
    kept = list(names) + list(fixed)
    missing = sorted(set(kept) - set(loaded.params))
    extra = sorted(set(loaded.params) - set(kept))
    bad = [n for n in kept if n in loaded.params and
           tuple(loaded.params[n].shape) != tuple(model.params[n].shape)]
    if missing or extra or bad:
        raise _deck_error(f"{loaded.path}: its tensors do not match this run's trainable set "
                          f"(missing {missing[:3]}, unexpected {extra[:3]}, other shape "
                          f"{bad[:3]}); resume with the deck it was written with "
                          f"(`semzo inspect` prints it) or set checkpoint.resume = \"never\"")
    xp = model.xp
    half = [n for n in kept if (loaded.params[n].dtype == BF16) != (model.params[n].dtype == BF16)]
    if half:
        raise _deck_error(f"{loaded.path}: {half[0]} is stored as "
                          f"{storage_name(loaded.params[half[0]].dtype)}, this run's model.dtype "
                          f"is {deck.model.dtype}; resume with the deck it was written with or "
                          f"set checkpoint.resume = \"never\"")
    for n in kept:
        dst = model.params[n]
        mod = xp if isinstance(dst, xp.ndarray) else np      # host_params: NumPy arrays
        mod.copyto(dst, mod.asarray(loaded.params[n]).astype(dst.dtype, copy=False))
    cur = np.asarray(loaded.per_rank["cursor"]).reshape(-1)
    # a cursor out of range would make the data order loop for ever (a negative position
    # never reaches the end of the shard): checked on every rank, refused on all
    agree(topo.world, cursor_error(loaded.path, topo.rank, cur, n_train_local))
    state = TrainState.from_dict({**loaded.state, "epoch": int(cur[0]), "pos": int(cur[1])})
    if loaded.resharded:
        log.info("finetune: resumed from %s (step %d) written at %d ranks, now %d: data "
                 "cursors remapped%s", loaded.path.name, loaded.step, loaded.world_size_saved,
                 topo.size, f", dropped {loaded.dropped}" if loaded.dropped else "")
    else:
        log.info("finetune: resumed from %s (step %d, same world size %d)", loaded.path.name,
                 loaded.step, topo.size)
    return ck, state, int(loaded.step), _stored_before(loaded.metrics)


def _stored_before(m: dict) -> tuple[float, float, int] | None:
    """The held-out (loss, accuracy, count) before fine-tuning that a checkpoint recorded
    (None for checkpoints written before it was recorded)."""
    try:
        return (float(m["heldout_loss_before"]), float(m["heldout_acc_before"]),
                int(m["heldout_n_before"]))
    except (KeyError, TypeError, ValueError):
        return None


def _centroids(ctx) -> dict:
    """``{"centroids": (k, d)}`` from clusters.h5 when it is there (rank 0 reads, then a
    broadcast), else ``{}``. Collective."""

    c = None
    if ctx.topo.rank == 0:
        p = ctx.path("clusters.h5")
        try:
            if p.is_file():
                with h5py.File(p, "r") as f:
                    if "centers" in f:
                        c = np.ascontiguousarray(f["centers"][()])
        except OSError as exc:
            log.warning("finetune: %s unreadable, checkpoints go without centroids: %s", p, exc)
    c = ctx.topo.world.bcast(c, root=0)
    return {} if c is None else {"centroids": c}


class _StepSaver:
    """The ``on_step`` hook: checkpoint every ``checkpoint.every_steps`` steps. The last
    train row's loss and g feed the metrics (averaged over ranks first, so every rank
    passes the same numbers). ``SEMZO_TEST_KILL`` = ``"rank:step"`` SIGKILLs that rank after
    that step, ``SEMZO_TEST_SIGNAL`` = ``"rank:step:SIGNAME"`` sends it that signal (fault
    tests only)."""

    def __init__(self, ck, model, names, n_local, *, centroids, topo, fixed=(), flush=None,
                 before=None, rows=None, keep_best: bool = False, by: str = "acc",
                 sync=None) -> None:
        self.before = before                     # held-out figures before fine-tuning
        self.rows = rows                         # the Metrics whose rows a checkpoint covers
        self.flush = flush or (lambda: None)     # the streamed step's deferred update
        # zo.restore = "fused" with several seed groups: the replicas drift by rounding until
        # a checksum step re-syncs them from rank 0, and each rank writes its own rows of a
        # checkpoint: every save re-syncs first (``sync(step)``, flushing too), so a file
        # holds one model and a resumed run starts where the uninterrupted one went on
        self.sync = sync
        self.ck, self.model, self.names, self.n_local = ck, model, names, int(n_local)
        self.stored = list(names) + list(fixed)  # what a checkpoint holds: + frozen LoRA A
        self.extras, self.topo = centroids, topo
        self.keep_best, self.by = keep_best, by
        self.last: dict = {}
        kill = os.environ.get("SEMZO_TEST_KILL", "")
        self.kill = tuple(int(x) for x in kill.split(":")) if kill else None
        sig = os.environ.get("SEMZO_TEST_SIGNAL", "")      # "rank:step:SIGNAME" (tests only)
        self.signal = (int(sig.split(":")[0]), int(sig.split(":")[1]),
                       sig.split(":")[2]) if sig else None

    def _settle(self, step: int) -> None:
        if self.sync is not None:
            self.sync(step)
        else:
            self.flush()

    def on_row(self, inner):
        def add(row: dict) -> None:
            if row.get("kind") == "train":
                self.last = row
            inner(row)
        return add

    def _payload(self, state: TrainState):
        d = state.to_dict()
        cursor = np.array([d.pop("epoch"), d.pop("pos")], np.int64)
        per_rank = {"cursor": cursor, "shard_size": np.int64(self.n_local)}
        m = np.array([float(self.last.get("loss", math.nan)),
                      float(self.last.get("g", math.nan))], np.float64)
        self.topo.allreduce(m)
        m /= self.topo.size
        metrics = {"loss": float(m[0]), "g": float(m[1]), "skips": state.skips}
        if self.before is not None:               # a resumed run reports them, not its own
            metrics.update(heldout_loss_before=float(self.before[0]),
                           heldout_acc_before=float(self.before[1]),
                           heldout_n_before=int(self.before[2]))
        params = {n: self.model.params[n] for n in self.stored}
        return params, d, per_rank, metrics

    def __call__(self, state: TrainState) -> None:
        if self.kill and self.kill == (self.topo.rank, state.step):

            os.kill(os.getpid(), signal.SIGKILL)
        if self.signal and self.signal[:2] == (self.topo.rank, state.step):

            os.kill(os.getpid(), getattr(signal, self.signal[2]))
        if self.signal:
            # tests: steps of a realistic length (a tiny model's steps take milliseconds: the
            # stop checks, about StopRequest.PERIOD_S apart, would then fall after the run)
            time.sleep(0.05)
        if self.ck.due(state.step):
            self._settle(state.step)              # save exactly the updated model
            if self.rows is not None:             # the rows up to here are on disk first
                self.rows.flush()
            params, d, per_rank, metrics = self._payload(state)
            self.ck.save(state.step, params, d, per_rank, self.extras, metrics)
        else:
            self.ck.poll()

    def on_eval(self, state: TrainState, loss: float, acc: float, test=None) -> None:
        """After a held-out evaluation (the parameters flushed): a new best (``by``: "acc",
        ties broken by the loss, or "loss") is recorded in the state and written to
        ``best.h5``. With a validation split, ``loss`` and ``acc`` are its figures (the
        choice reads them) and ``test`` the held-out (loss, accuracy). Collective (every rank
        holds the same evaluation)."""
        if not self.keep_best or not state.better(loss, acc, self.by):
            return
        tl, ta = (loss, acc) if test is None else test
        state.best_step, state.best_acc, state.best_loss = state.step, float(acc), float(loss)
        state.best_test_acc, state.best_test_loss = float(ta), float(tl)
        self._settle(state.step)
        params, d, per_rank, metrics = self._payload(state)
        metrics.update({"heldout_loss": float(tl), "heldout_acc": float(ta)})
        if test is not None:
            metrics.update({"val_loss": float(loss), "val_acc": float(acc)})
        self.ck.save_best(state.step, params, d, per_rank, self.extras, metrics)

    def rollback(self, state: TrainState, engine) -> None:
        """The held-out guard tripped: the trainable tensors (and the engine's reference
        copies) become ``best.h5``'s, read back verified. A damaged or missing ``best.h5``
        leaves the parameters as they are (the lr is halved all the same), with a warning.
        Collective."""
        try:
            loaded = self.ck.load_best()
        except CheckpointError as exc:
            if self.topo.rank == 0:
                log.warning("held-out guard: cannot read the best model back (%s): training "
                            "goes on from the current parameters at the halved lr", exc)
            return
        if loaded.step != state.best_step:
            # a resumed run whose interrupted predecessor wrote a newer best.h5 after the
            # checkpoint it resumed from: the model the state's best refers to is gone
            if self.topo.rank == 0:
                log.warning("held-out guard: %s holds the model of step %d, not this run's "
                            "best (step %d: an interrupted run saved a later best after the "
                            "checkpoint this one resumed from); training goes on from the "
                            "current parameters at the halved lr", self.ck.dir / "best.h5",
                            loaded.step, state.best_step)
            return
        engine.reload({i: loaded.params[n] for i, n in enumerate(self.names)})
        if state.label_rows.size:        # the trained label rows go back with the model
            a = np.asarray(loaded.state.get("label_rows", np.zeros(0)), np.float64)
            if a.shape == state.label_rows.shape:
                state.label_rows = a.copy()

    def final(self, state: TrainState) -> None:
        """The last checkpoint (a no-op when this step was just saved); the checkpointer
        stays open for :meth:`on_eval` of the final evaluation (:meth:`close`)."""
        try:
            if state.step != self.ck.last_step:
                self._settle(state.step)
                params, d, per_rank, metrics = self._payload(state)
                self.ck.save(state.step, params, d, per_rank, self.extras, metrics)
        except BaseException:
            self.ck.close()
            raise

    def close(self) -> None:
        self.ck.close()


def save_model(ctx, model, names: list[str], which: str, task_kind: str,
               label_names: list[str], state: TrainState, before, after,
               meta: dict | None = None, fixed: list[str] = ()) -> None:
    """Write model.h5: every rank writes a block of rows of each tensor (replicas are
    identical); ``which = "trainable"``: the trained tensors and the ``fixed`` ones (frozen
    LoRA A matrices). ``meta``: the checkpoints' ``model_meta`` (head, LoRA, model folder and its
    checksum), stored alike so that `semzo generate/export/inspect` read model.h5 as they read
    a checkpoint (:mod:`semzo.checkpoint.modelfile`). Collective over the world."""
    comm = ctx.topo.world
    saved = list(names) + list(fixed) if which == "trainable" else list(model.params)
    lora = {m: {"a": s.a, "b": s.b, "scale": s.scale} for m, s in model.lora.items()}
    attrs = {"model_source": str(model.source or ""), "task": task_kind,
             "trainable": json.dumps(names), "lora": json.dumps(lora),
             "label_names": string_array(label_names),
             "head_normalize": bool(model.head.normalize) if model.head else False,
             "steps": state.step, "skips": state.skips, "weight_storage": model.storage,
             "heldout_loss_before": _num(before[0]), "heldout_acc_before": _num(before[1]),
             "heldout_loss_after": _num(after[0]), "heldout_acc_after": _num(after[1]),
             "model_meta": json.dumps(meta or {}, sort_keys=True)}
    arrays = {name: model.params[name] for name in saved}
    if state.label_rows.size:              # train.label_rows = "exact" (label_rows.py)
        arrays[lr_rows.DELTA] = state.label_rows[0].astype(np.float32)
        arrays[lr_rows.WORD_IDS] = state.label_row_ids
    with create_collective(ctx.path("model.h5"), comm, ctx.deck.to_toml(), **attrs) as f:
        for name, arr in arrays.items():
            host = np.ascontiguousarray(arr.get() if hasattr(arr, "get") else arr)
            if host.ndim == 0:
                host = host.reshape(1)
            dset = f.create_dataset(name, shape=host.shape, dtype=host.dtype)
            lo, hi = row_range(host.shape[0], comm)
            write_slab(dset, lo, host[lo:hi])


def _num(x: float) -> float:
    return float(x) if math.isfinite(x) else float("nan")

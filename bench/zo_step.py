"""semzo's ZO step against a faithful MeZO-style torch step, same model, batch and threads.

    .venv/bin/python bench/zo_step.py [--threads 2] [--batch 16] [--length 64] [--reps 3]
    timeout 600 mpirun -n 4 .venv/bin/python bench/zo_step.py --comm [--reps 5]

Model: all-MiniLM-L6-v2 (22.7M parameters) with a 16-class head, full-parameter ZO (every
tensor trainable, as in MeZO), a batch of the first ``--batch`` fortunes padded to
``--length`` tokens (38 % padding at 16 x 64: semzo's encoder skips it on the CPU, torch
computes the padded rows, as MeZO's trainer does). Printed figures:

1. semzo step time / (2 x semzo forward time) on that batch (goal <= 1.10; the headline figure
   from forward passes and default steps alternated, ``--reps`` rounds after a warm-up, best of
   each; the other steps best of ``--reps`` each), for the default
   block-streamed schedule (two parameter passes per step, the update deferred) and for the
   three-pass schedule, with Gaussian, Rademacher and Gaussian-fast z (a 16-bit inverse-CDF
   table, ``zo.dist = "gaussian-fast"``); one parameter pass: the plain fused
   read-modify-write (no z) against the perturbation with Gaussian and Rademacher z (goal: a
   pass that generates z costs <= 1.2x the plain pass); the streamed step with and without
   the z cache (``zo.cache_z``: pass 2 reads the z pass 1 made for the stage), and with
   every word-embedding row in both passes against the default, which defers the rows the
   batch does not read (same bits; docs/finetune.md), also timed in alternating pairs; the
   z floor: the fewest z a two-pass step keeping no z between steps makes, generated alone
   (bench/zo_pass.py), and the ratio that leaves even with free memory passes;
2. semzo step time vs the MeZO-style torch step (MeZO's trainer: per tensor an out-of-place
   ``torch.normal`` perturbation +eps, forward, -2 eps, forward, +eps restore, then the update
   with z regenerated from the same seed), same model and batch, same threads;
3. peak memory of a ZO step vs parameter bytes plus one forward's activations (goal
   <= 1.15x), and vs a backprop fine-tuning step in torch (AdamW, same model and batch): each
   measured in its own process as the peak RSS during the step (VmHWM, reset before it) above
   the RSS before the model is loaded, and for semzo also with tracemalloc (numpy's
   allocations: the transient peak above the parameters, plus the z cache the streamed step
   keeps), streamed and three-pass, and what the streamed step's second branch state adds;
4. ``--comm`` under mpirun: communication time as a share of the step time in data mode (the
   engine's time inside the exchange, which includes waiting for the slowest rank, and the
   exchange collective alone, timed after a barrier).

The torch measurements run in processes of their own: numba's and torch's OpenMP thread pools
in one process slow each other down badly on a loaded machine.

Other people's processes on a shared machine make timings noisy: say so when reporting.
"""

from __future__ import annotations  # noqa: I001 (semzo is imported before numpy)

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import semzo  # noqa: F401  (before numpy: the thread-pool defaults)
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EPS, LR = 1e-3, 1e-6


def batch(n: int, length: int):
    from semzo.model import Tokenizer

    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(n))]
    tok = Tokenizer.from_folder(None, max_length=length)
    ids, mask = tok.pad(tok.encode_batch(texts), length)
    labels = np.arange(n) % 16
    return ids, mask, labels


class Solo:
    """One-rank stand-in for the topology (no MPI)."""

    rank, size, node_id, n_nodes = 0, 1, 0, 1

    def allreduce(self, buf, op=None):
        return buf


def semzo_setup(threads: int, schedule: str = "streamed"):
    from semzo.backend import set_threads
    from semzo.model import load_model
    from semzo.model import set_threads as split_forwards
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors

    set_threads(threads)

    split_forwards(threads)
    m = load_model(None)
    m.add_classifier(16, normalize=True)
    tensors = ztensors(list(m.named_parameters()))
    return m, ZOEngine(tensors, Solo(), eps=EPS, threads=threads, schedule=schedule)


def bench_task(m, ids, mask, labels):
    """A classification task over one fixed batch (the stage interface for the streamed
    step) and that batch."""
    from semzo.tasks.classify import ClassifyTask
    none = np.zeros(0, np.int64)
    return ClassifyTask(m, [], labels, none, none, 0, 16), (ids, mask, labels, len(labels))


def zo_step_fn(m, eng, ids, mask, labels, n):
    """A function running one ZO step of ``eng``'s schedule per call (fresh step index)."""
    from semzo.zo.streamed import step_streamed
    task, b = bench_task(m, ids, mask, labels)
    k = [0]

    def zo():
        k[0] += 1
        if eng.schedule == "streamed":
            step_streamed(eng, task, b, k[0], LR, n)
        else:
            eng.step(lambda: m.classify(ids, mask, labels)[0], k[0], LR, n)
    return zo


def pass_times(eng, reps: int) -> dict:
    """One pass over every parameter: the plain fused read-modify-write (p <- p + a, no z,
    same launch, chunks and bytes), the perturbation with Gaussian, Rademacher and
    Gaussian-fast z, the
    streamed schedule's first pass (restore + update of one z, then + eps of another), that
    first pass also storing its second z (the z cache; Gaussian), and the pass that reads it
    back (pass 2 with the z cache: p <- p + a z_cached)."""
    from semzo import rng
    from semzo.zo import kernels
    from semzo.zo.perturb import _split
    cpu, _ = _split(eng.tensors, 0.0)
    k0, k1 = rng.split_seed(12345)
    out = {}
    with kernels.num_threads(eng.threads):
        out["plain"] = best(lambda: kernels.run_pass(cpu, kernels.PLAIN, 0, k0, k1, a=0.0),
                            reps)
        for name, code in (("gaussian", 0), ("rademacher", 1), ("gaussian-fast", 2)):
            out[name] = best(lambda c=code: kernels.run_pass(cpu, kernels.PERTURB, c, k0, k1,
                                                             a=0.0), reps)
            out[name + "_first"] = best(lambda c=code: kernels.run_pass(
                cpu, kernels.RESTORE_UPDATE, c, k0, k1, a=0.0, post=(k1, k0, 0.0)), reps)
        zb = [np.empty(c[0].size, np.float32) for c in cpu]
        out["gaussian_first_cache"] = best(lambda: kernels.run_pass(
            cpu, kernels.RESTORE_UPDATE, 0, k0, k1, a=0.0, post=(k1, k0, 0.0), zbufs=zb), reps)
        out["cached"] = best(lambda: kernels.run_pass(cpu, kernels.CACHED, 0, 0, 0, a=0.0,
                                                      zbufs=zb), reps)
    return out


@contextlib.contextmanager
def pass_clock():
    """Seconds spent in the ZO kernels' launches (``kernels.run_pass`` and ``run_spans``)
    while the block runs, in ``clock[0]``: the parameter passes of a step without its
    forwards, whose noise on a shared machine hides a few percent of the step."""
    from semzo.zo import kernels
    clock = [0.0]
    saved = {nm: getattr(kernels, nm) for nm in ("run_pass", "run_spans")}

    def timed(f):
        def g(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                clock[0] += time.perf_counter() - t0
        return g
    for nm, f in saved.items():
        setattr(kernels, nm, timed(f))
    try:
        yield clock
    finally:
        for nm, f in saved.items():
            setattr(kernels, nm, f)


def deferral_pairs(eng, zo, rounds: int, fwd=None) -> dict:
    """Deferred embedding rows (``eng.defer_rows``) against every row, in alternating pairs:
    ``rounds`` rounds after a warm-up, each timing one step of ``zo`` each way (after a flush
    and an untimed step, so both carry a pending update) and, with ``fwd``, one call of it.
    Returns lists per round: ``{True: step s, False: step s, "pass": {True:, False:} (time in
    the kernel launches, :func:`pass_clock`), "fwd": s}``; leaves deferral on, flushed."""
    out: dict = {True: [], False: [], "pass": {True: [], False: []}, "fwd": []}
    for r in range(rounds + 1):                     # round 0: warm-up
        for flag in (True, False):
            eng.flush()
            eng.defer_rows = flag
            zo()
            with pass_clock() as clock:
                t = once(zo)
            if r:
                out[flag].append(t)
                out["pass"][flag].append(clock[0])
        if fwd is not None:
            t = once(fwd)
            if r:
                out["fwd"].append(t)
    eng.flush()
    eng.defer_rows = True
    return out


def z_floor(count: int, threads: int, reps: int) -> dict:
    """Seconds to generate ``count`` z alone (no memory traffic; bench/zo_pass.py), for each
    distribution: with ``count`` the fewest z a step can make (see the printed line), a floor
    under the step's time above its two forwards."""
    from zo_pass import z_alone_s

    return {"count": count, **{d: z_alone_s(count, d, threads, reps)
                               for d in ("gaussian", "gaussian-fast", "rademacher")}}


def torch_setup(threads: int):
    import torch
    from transformers import AutoModel

    from semzo.model import default_model_path

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    body = AutoModel.from_pretrained(str(default_model_path())).eval()
    head = torch.nn.Linear(body.config.hidden_size, 16)
    return torch, body, head


def torch_loss(torch, body, head, ids, mask, labels):
    out = body(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    pooled = (out * m).sum(1) / m.sum(1).clamp(min=1e-9)
    pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return torch.nn.functional.cross_entropy(head(pooled), labels)


def mezo_step(torch, params, loss_fn, step: int, wd: float = 0.0):
    """MeZO's trainer (large_models/trainer.py): zo_perturb_parameters x3, then zo_update."""
    seed = 1000 + step

    def perturb(scale):
        torch.manual_seed(seed)
        for _, p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device,
                             dtype=p.data.dtype)
            p.data = p.data + scale * z * EPS

    with torch.no_grad():
        perturb(1)
        l1 = loss_fn()
        perturb(-2)
        l2 = loss_fn()
        g = float((l1 - l2) / (2 * EPS))
        perturb(1)
        torch.manual_seed(seed)
        for name, p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), device=p.data.device,
                             dtype=p.data.dtype)
            if "bias" not in name and "LayerNorm" not in name:
                p.data = p.data - LR * (g * z + wd * p.data)
            else:
                p.data = p.data - LR * g * z


def best(f, reps: int) -> float:
    f()                                           # warm-up (numba cache load, allocations)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def once(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def timings(args) -> dict:
    ids, mask, labels = batch(args.batch, args.length)
    m, eng = semzo_setup(args.threads)

    def fwd_once():
        m.classify(ids, mask, labels)
    # the headline ratio: forward and default step alternated, best of each (a load that
    # drifts during the run then biases both alike); the other steps below, best of each
    zo = zo_step_fn(m, eng, ids, mask, labels, args.batch)
    fwd = step = float("inf")
    for r in range(args.reps + 1):                 # round 0: warm-up
        tf, ts = once(fwd_once), once(zo)
        if r:
            fwd, step = min(fwd, tf), min(step, ts)
    out = {"semzo_forward_s": fwd, "trainable": eng.n_trainable,
           "step_streamed_gaussian_alt_s": step}
    for sched in ("streamed", "three-pass"):
        eng.flush()
        eng.schedule = sched
        zo = zo_step_fn(m, eng, ids, mask, labels, args.batch)
        for dist in ("gaussian", "rademacher", "gaussian-fast"):
            eng.flush()
            eng.dist = dist
            out[f"step_{sched}_{dist}_s"] = best(zo, args.reps)
            if sched == "streamed" and dist != "rademacher":     # zo.cache_z = false
                eng.cache_z = False
                out[f"step_{sched}_{dist}_nocache_s"] = best(zo, args.reps)
                eng.cache_z = True
            if sched == "streamed":          # every embedding row in both passes
                eng.flush()
                eng.defer_rows = False
                out[f"step_{sched}_{dist}_allrows_s"] = best(zo, args.reps)
                eng.flush()
                eng.defer_rows = True
    eng.flush()
    eng.dist, eng.schedule = "gaussian", "streamed"
    # deferred embedding rows against every row, paired: each round times one step of each
    # (after a flush and an untimed step, so both carry a pending update), best and median
    pair = deferral_pairs(eng, zo_step_fn(m, eng, ids, mask, labels, args.batch),
                          2 * args.reps)
    out["deferred_pair"] = [float(np.min(pair[True])), float(np.median(pair[True])),
                            float(np.min(pair[False])), float(np.median(pair[False]))]
    out["passes"] = pass_times(eng, args.reps)
    emb = m.params["embeddings.word_embeddings.weight"]
    unread = emb.size - int(np.unique(ids).size) * emb.shape[1]
    out["z_floor"] = z_floor(2 * eng.n_trainable - unread, args.threads, args.reps)
    task, b = bench_task(m, ids, mask, labels)
    st = task.stage_begin(b)
    for k in range(task.stage_count()):
        task.stage_run(k, st)
    out["branch_state_bytes"] = st.nbytes_live()
    out["rows_read"] = (int(np.unique(ids).size), int(emb.shape[0]), int(emb.size))
    t = _child_json("--torch-times", args)
    out.update(torch_forward_s=t["torch_forward_s"], mezo_torch_step_s=t["mezo_torch_step_s"])
    return out


def torch_times(args) -> None:
    """The peer's timings, in a process of its own (torch's and numba's thread pools never
    share one). Prints JSON."""
    ids, mask, labels = batch(args.batch, args.length)
    torch, body, head = torch_setup(args.threads)
    tids, tmask, tlab = (torch.from_numpy(ids), torch.from_numpy(mask),
                         torch.from_numpy(labels))
    params = [(n, p) for n, p in body.named_parameters()] + \
        [(f"head.{n}", p) for n, p in head.named_parameters()]

    def tloss():
        return torch_loss(torch, body, head, tids, tmask, tlab)

    with torch.no_grad():
        tfwd = best(tloss, args.reps)
    j = [0]

    def tstep():
        j[0] += 1
        mezo_step(torch, params, tloss, j[0])

    tzo = best(tstep, args.reps)
    print("JSON " + json.dumps({"torch_forward_s": tfwd, "mezo_torch_step_s": tzo}))


def _child_json(flag: str, args, *extra: str) -> dict:
    p = subprocess.run([sys.executable, __file__, flag, *extra, "--threads", str(args.threads),
                        "--batch", str(args.batch), "--length", str(args.length), "--reps",
                        str(args.reps)], capture_output=True, text=True, timeout=900,
                       check=False)
    line = [x for x in p.stdout.splitlines() if x.startswith("JSON ")]
    if not line:
        raise RuntimeError(f"{flag} {' '.join(extra)} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[0][5:])


def mem_child(what: str, args) -> None:
    """Run one measurement in this (fresh) process; print JSON.

    footprint = peak RSS during the operation (VmHWM, reset just before it through
    /proc/self/clear_refs) minus the RSS after the imports, before the model is loaded: the
    parameters, anything the operation keeps (gradients, optimizer state) and its transient
    peak. Every operation runs once before the measured run (warm-up)."""
    import tracemalloc

    ids, mask, labels = batch(args.batch, args.length)
    out = {}
    if what.startswith("semzo"):
        import numba  # noqa: F401 - imported before the baseline like numpy

        rss0 = _status("VmRSS")
        m, eng = semzo_setup(args.threads)
        out["param_bytes"] = sum(a.nbytes for a in m.params.values())
        if what == "semzo-fwd":
            def op():
                m.classify(ids, mask, labels)
        else:
            eng.schedule = "three-pass" if what == "semzo-step-3pass" else "streamed"
            op = zo_step_fn(m, eng, ids, mask, labels, args.batch)
        op()
        tracemalloc.start()
        t0 = tracemalloc.get_traced_memory()[0]
        _reset_peak()
        op()
        peak = _status("VmHWM")
        out["traced_peak_bytes"] = tracemalloc.get_traced_memory()[1] - t0
        tracemalloc.stop()
        # the z cache (streamed): allocated in the warm-up step and kept, so not in the peak
        zc = eng._zcache
        out["zcache_bytes"] = 4 * zc[1].elements if zc is not None and what == "semzo-step" \
            else 0
    else:
        import torch as _torch  # noqa: F401 - imported before the baseline

        rss0 = _status("VmRSS")
        torch, body, head = torch_setup(args.threads)
        params = [p for p in body.parameters()] + list(head.parameters())
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        tids, tmask, tlab = (torch.from_numpy(ids), torch.from_numpy(mask),
                             torch.from_numpy(labels))
        if what == "torch-backprop":
            body.train()
            opt = torch.optim.AdamW(params, lr=1e-5)

            def op():
                loss = torch_loss(torch, body, head, tids, tmask, tlab)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
        else:
            named = [(n, p) for n, p in body.named_parameters()]

            def op():
                mezo_step(torch, named, lambda: torch_loss(torch, body, head, tids, tmask,
                                                           tlab), 1)
        op()
        _reset_peak()
        op()
        peak = _status("VmHWM")
    out["footprint_bytes"] = peak - rss0
    print("JSON " + json.dumps(out))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:      # "5": reset the peak RSS (VmHWM)
        f.write("5")


def memory(args) -> dict:
    return {what: _child_json("--mem", args, what)
            for what in ("semzo-fwd", "semzo-step", "semzo-step-3pass", "torch-mezo",
                         "torch-backprop")}


def comm_share(args) -> None:
    from mpi4py import MPI

    from semzo.backend import set_threads
    from semzo.deck import TopologySection
    from semzo.model import load_model
    from semzo.model import set_threads as split_forwards
    from semzo.runtime import run_spmd
    from semzo.topology import build_topology
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors

    def main():
        comm = MPI.COMM_WORLD
        topo = build_topology(comm, TopologySection(ranks_per_node=1, nodes_per_switch=2))
        set_threads(1)
        split_forwards(1)
        ids, mask, labels = batch(args.batch, args.length)
        m = load_model(None)
        m.add_classifier(16, normalize=True)
        eng = ZOEngine(ztensors(list(m.named_parameters())), topo, eps=EPS, threads=1)
        rows = []
        for s in range(args.reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            r = eng.step(lambda: m.classify(ids, mask, labels)[0], s, LR, args.batch)
            rows.append((time.perf_counter() - t0, r.comm_s))
        ex = []
        for _ in range(20):
            buf = np.array([1.0, 16.0, 2.0, 0.0])
            comm.Barrier()
            t0 = time.perf_counter()
            topo.allreduce(buf)
            ex.append(time.perf_counter() - t0)
        rows = np.array(rows[1:])
        mx = np.empty_like(rows)
        comm.Allreduce(rows, mx, op=MPI.MAX)
        if comm.Get_rank() == 0:
            step, c = mx[:, 0].mean(), mx[:, 1].mean()
            print(f"data mode, {comm.Get_size()} ranks ({topo.n_nodes} nodes, "
                  f"{topo.n_switches} switches, hierarchical allreduce), 1 thread each:")
            print(f"  step time (slowest rank, mean of {len(rows)}): {step:.3f} s")
            print(f"  engine time inside the exchange (incl. waiting for the slowest rank): "
                  f"{c * 1e3:.2f} ms = {c / step:.2%} of the step")
            print(f"  the exchange allreduce alone (after a barrier, median of 20): "
                  f"{np.median(ex) * 1e6:.1f} us = {np.median(ex) / step:.4%} of the step "
                  f"(goal < 1%)")
        topo.free()

    run_spmd(main)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--comm", action="store_true")
    ap.add_argument("--mem", default=None)
    ap.add_argument("--torch-times", action="store_true")
    from zo_step_llm import add_args, llm_main  # --model smollm2: bench/zo_step_llm.py
    add_args(ap)
    args = ap.parse_args()
    if args.model == "smollm2":
        llm_main(args)
        return
    if args.torch_times:
        torch_times(args)
        return
    if args.mem:
        mem_child(args.mem, args)
        return
    if args.comm:
        comm_share(args)
        return
    t = timings(args)
    mem = memory(args)
    mib = 2.0 ** 20
    print(f"ZO step, all-MiniLM-L6-v2 + 16-class head, full-parameter ({t['trainable']:,} "
          f"trainable), batch {args.batch} x {args.length} tokens, {args.threads} threads; "
          f"best of {args.reps}")
    fw = t["semzo_forward_s"]
    ms = 1e3
    step = t["step_streamed_gaussian_alt_s"]
    ratio = step / (2 * fw)
    print(f"  schedule streamed (the default): semzo forward {fw:.3f} s, step {step:.3f} s: "
          f"step / (2 x forward) = {ratio:.3f} (goal <= 1.10)")
    s3 = t["step_three-pass_gaussian_s"]
    sg = t["step_streamed_gaussian_s"]
    print(f"  schedule three-pass: step {s3:.3f} s, ratio {s3 / (2 * fw):.3f}; streamed / "
          f"three-pass = {sg / s3:.3f} (streamed {sg:.3f} s, timed like the three-pass step)")
    sr, s3r = t["step_streamed_rademacher_s"], t["step_three-pass_rademacher_s"]
    print(f"  with Rademacher z: streamed step {sr:.3f} s, ratio {sr / (2 * fw):.3f}; "
          f"three-pass {s3r:.3f} s, ratio {s3r / (2 * fw):.3f}")
    ps = t["passes"]
    print(f"  one pass over the parameters: plain read-modify-write (no z) "
          f"{ps['plain'] * ms:.1f} ms; perturb Gaussian {ps['gaussian'] * ms:.1f} ms = "
          f"{ps['gaussian'] / ps['plain']:.2f}x plain, Rademacher {ps['rademacher'] * ms:.1f} "
          f"ms = {ps['rademacher'] / ps['plain']:.2f}x plain (goal <= 1.2x); streamed first "
          f"pass (update + perturb, two z) Gaussian {ps['gaussian_first'] * ms:.1f} ms, "
          f"Rademacher {ps['rademacher_first'] * ms:.1f} ms")
    sf, s3f = t["step_streamed_gaussian-fast_s"], t["step_three-pass_gaussian-fast_s"]
    print(f"  with zo.dist = \"gaussian-fast\" (16-bit inverse-CDF table): pass "
          f"{ps['gaussian-fast'] * ms:.1f} ms = {ps['gaussian-fast'] / ps['plain']:.2f}x plain "
          f"(goal <= 1.2x), {ps['gaussian-fast'] / ps['gaussian']:.2f}x the Gaussian pass; "
          f"streamed first pass {ps['gaussian-fast_first'] * ms:.1f} ms; streamed step "
          f"{sf:.3f} s, ratio {sf / (2 * fw):.3f}; three-pass {s3f:.3f} s, ratio "
          f"{s3f / (2 * fw):.3f}")
    sp = t["mezo_torch_step_s"] / step
    sn, sfn = t["step_streamed_gaussian_nocache_s"], t["step_streamed_gaussian-fast_nocache_s"]
    print(f"  z cache (zo.cache_z, pass 2 reads pass 1's z): streamed Gaussian step {sg:.3f} s "
          f"with, {sn:.3f} s without (ratio {sn / (2 * fw):.3f}); gaussian-fast {sf:.3f} s with, "
          f"{sfn:.3f} s without; over every parameter, first pass storing z "
          f"{ps['gaussian_first_cache'] * ms:.1f} ms (not storing {ps['gaussian_first'] * ms:.1f}"
          f"), second pass reading it {ps['cached'] * ms:.1f} ms (generating: Gaussian "
          f"{ps['gaussian'] * ms:.1f})")
    ra, rf, rr = (t[f"step_streamed_{d}_allrows_s"]
                  for d in ("gaussian", "gaussian-fast", "rademacher"))
    nread, nrows, nel = t["rows_read"]
    db, dm, ab, am = t["deferred_pair"]
    print(f"  deferred embedding rows (the batch reads {nread} of {nrows} word-embedding rows, "
          f"{nel / t['trainable']:.0%} of the parameters): streamed Gaussian step {sg:.3f} s "
          f"deferring the rest, {ra:.3f} s with every row in both passes (ratio "
          f"{ra / (2 * fw):.3f}); gaussian-fast {sf:.3f} s against {rf:.3f} s; Rademacher "
          f"{sr:.3f} s against {rr:.3f} s; paired, alternating ({2 * args.reps} rounds): "
          f"Gaussian {db:.3f} s best, {dm:.3f} s median deferring, {ab:.3f} s best, "
          f"{am:.3f} s median with every row: {ab / db:.3f}x best, {am / dm:.3f}x median")
    zf = t["z_floor"]
    print(f"  z floor: a two-pass step that keeps no z from one step to the next makes at "
          f"least {zf['count']:,} z (two per element the batch reads: the last update's and "
          f"this step's; one per deferred row element); made alone, never stored: Gaussian "
          f"{zf['gaussian'] * ms:.1f} ms, gaussian-fast {zf['gaussian-fast'] * ms:.1f} ms, "
          f"Rademacher {zf['rademacher'] * ms:.1f} ms; so step / (2 x forward) >= "
          f"{1 + zf['gaussian'] / (2 * fw):.3f} with Gaussian z, "
          f"{1 + zf['gaussian-fast'] / (2 * fw):.3f} gaussian-fast, "
          f"{1 + zf['rademacher'] / (2 * fw):.3f} Rademacher, on this machine")
    print(f"  peer MeZO-style torch step {t['mezo_torch_step_s']:.3f} s (torch forward "
          f"{t['torch_forward_s']:.3f} s): semzo is {sp:.2f}x faster")
    pb = mem["semzo-step"]["param_bytes"]
    fwd_act = mem["semzo-fwd"]["traced_peak_bytes"]
    step_tr = mem["semzo-step"]["traced_peak_bytes"]
    zcb = mem["semzo-step"]["zcache_bytes"]
    r_tr = (pb + step_tr + zcb) / (pb + fwd_act)
    zs, zf = mem["semzo-step"]["footprint_bytes"], mem["semzo-fwd"]["footprint_bytes"]
    print(f"  memory: parameters {pb / mib:.1f} MiB; transient peak above the parameters "
          f"(tracemalloc): forward {fwd_act / mib:.1f} MiB, ZO step {step_tr / mib:.1f} MiB; "
          f"z cache {zcb / mib:.1f} MiB (kept between steps)")
    print(f"    (parameters + ZO step peak + z cache) / (parameters + forward peak) = {r_tr:.3f} "
          f"(goal <= 1.15); by RSS footprint (peak RSS minus RSS before the model): ZO step "
          f"{zs / mib:.0f} MiB / forward {zf / mib:.0f} MiB = {zs / zf:.3f}")
    tb = mem["torch-backprop"]["footprint_bytes"]
    tm = mem["torch-mezo"]["footprint_bytes"]
    s3m = mem["semzo-step-3pass"]["traced_peak_bytes"]
    print(f"    three-pass step peak {s3m / mib:.1f} MiB; the streamed step's second branch "
          f"state (lockstep) adds {t['branch_state_bytes'] / mib:.2f} MiB "
          f"(B x T x H float32)")
    print(f"    RSS footprint: semzo ZO step {zs / mib:.0f} MiB, torch MeZO-style step "
          f"{tm / mib:.0f} MiB, torch backprop + AdamW step {tb / mib:.0f} MiB: semzo / "
          f"backprop = {zs / tb:.3f}, semzo / MeZO-torch = {zs / tm:.3f}")


if __name__ == "__main__":
    main()

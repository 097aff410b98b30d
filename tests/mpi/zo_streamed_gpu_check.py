"""GPU check of the block-streamed schedule and host offload (run by hand, or by the GPU
bring-up kit, on a machine with CuPy and a GPU; no MPI launch): on the device, the streamed
step (one fused ``zo_stream`` launch per pass) equals the three-pass step bit for bit, the
offloaded step (``HostStore``: pinned host memory, copy and write-back streams, two block
slots) equals the resident streamed step bit for bit, with its device slot bytes and timings.

usage: PYTHONPATH=src:tests/mpi python tests/mpi/zo_streamed_gpu_check.py [WORKDIR]
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from zo_common import SoloTopo, corpus, make_model

from semzo.finetune.loop import evaluate
from semzo.model import Tokenizer, load_model
from semzo.preflight import heldout_mask
from semzo.tasks.classify import ClassifyTask
from semzo.tasks.lm import LMTask
from semzo.zo.engine import ZOEngine
from semzo.zo.offload import HostStore
from semzo.zo.perturb import ztensors
from semzo.zo.streamed import step_streamed


def run(folder, kind, schedule, offload, steps=5):
    import cupy

    m = load_model(folder, xp=cupy, host_params=offload)   # as the finetune stage loads it
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(64)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    held = heldout_mask(np.arange(64), 0, 0.25)
    tr, he = np.flatnonzero(~held), np.flatnonzero(held)
    if kind == "bert":
        m.add_classifier(3, normalize=True, std=0.5)
        task = ClassifyTask(m, seqs, labels, tr, he, tok.pad_id, 16)
    else:
        task = LMTask(m, seqs, labels, tr, he, tok.pad_id, 16)
    names = [n for n, _ in m.named_parameters()]
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   weight_decay=0.01, schedule=schedule)
    if offload:
        eng.store = HostStore(m, task, eng, device="gpu")
    eng.loss_hook = lambda s, x: math.nan if s == 2 else x
    t0 = time.perf_counter()
    out = []
    for s in range(steps):
        b = task.batch(np.arange(8 * s, 8 * s + 8))
        r = (step_streamed(eng, task, b, s, 1e-2, 8) if schedule == "streamed"
             else eng.step(lambda b=b: task.loss(b), s, 1e-2, 8))
        out.append((r.lp, r.lm))
    eng.flush()
    cupy.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    ev = evaluate(task, SoloTopo(), eng.store)      # offload: every stage streamed per batch
    host = {n: (a.get() if hasattr(a, "get") else np.asarray(a)) for n, a in m.params.items()}
    return np.array(out), host, dt, eng, ev


def check(work: Path) -> None:
    import cupy

    print("GPU:", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for kind in ("bert", "gpt2", "llama_tied"):
        folder = make_model(work / kind, kind=kind)
        ref, pref, t3, _, eref = run(folder, kind, "three-pass", False)
        got, pgot, ts, _, egot = run(folder, kind, "streamed", False)
        off, poff, to, eng, eoff = run(folder, kind, "streamed", True)
        assert got.tobytes() == ref.tobytes(), (kind, got, ref)
        assert all(pgot[n].tobytes() == pref[n].tobytes() for n in pref), kind
        assert off.tobytes() == ref.tobytes(), (kind, off, ref)
        assert all(poff[n].tobytes() == pref[n].tobytes() for n in pref), kind
        assert eref == egot == eoff, (kind, eref, egot, eoff)
        assert all(isinstance(a, np.ndarray) for a in eng.store.host.values())
        print(f"{kind}: streamed == three-pass == offloaded bit for bit; 5 steps three-pass "
              f"{t3:.3f} s, streamed {ts:.3f} s, offloaded {to:.3f} s; device slots "
              f"{eng.store.device_bytes() / 2**20:.2f} MiB, {eng.store.uploads} uploads")
    print("ok: zo streamed gpu check")


def main() -> None:
    check(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))


if __name__ == "__main__":
    main()

"""GPU check of the ZO engine (run by hand on a machine with CuPy and a GPU; no MPI launch):
the same steps on numpy and cupy agree to rounding, checksums run on the device, float16
storage trains with finite losses, the head-only feature task runs on the device.

usage: PYTHONPATH=src:tests/mpi python tests/mpi/zo_gpu_check.py [WORKDIR]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from zo_common import SoloTopo, corpus, make_model

from semzo.finetune.data import pad_batch
from semzo.finetune.engine import ZOEngine, param_checksum, ztensors
from semzo.finetune.loop import FeatureClassifyTask
from semzo.finetune.stage import select_trainable
from semzo.model import Tokenizer, load_model


def run(folder, xp, dtype="float32", params="all", steps=5):
    m = load_model(folder, xp=xp, dtype=dtype)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, params, lora_rank=2)
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(64)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   weight_decay=0.01)
    losses = []
    for s in range(steps):
        rows = recs[8 * s:8 * s + 8]
        ids, mask = pad_batch(tok.encode_batch([r["text"] for r in rows]), 0)
        lab = np.array([int(r["label"][-1]) for r in rows])
        res = eng.step(lambda ids=ids, mask=mask, lab=lab: m.classify(ids, mask, lab)[0], s,
                       1e-2, 8)
        assert res.ok, (xp.__name__, dtype, s)
        losses.append(res.loss)
    host = {n: (m.params[n].get() if hasattr(m.params[n], "get") else m.params[n])
            for n in names}
    return host, losses, param_checksum(eng.tensors), eng


def main() -> None:
    import cupy

    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    folder = make_model(work / "bert")
    print("GPU:", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for params in ("all", "lora"):
        a, la, ca, _ = run(folder, np, params=params)
        t0 = time.perf_counter()
        b, lb, cb, _ = run(folder, cupy, params=params)
        dt = time.perf_counter() - t0
        worst = max(float(np.max(np.abs(a[n] - b[n]))) for n in a)
        print(f"{params}: numpy losses {np.round(la, 6).tolist()}")
        print(f"{params}: cupy  losses {np.round(lb, 6).tolist()} ({dt:.2f} s)")
        print(f"{params}: max |theta_numpy - theta_cupy| after 5 steps = {worst:.3e}; "
              f"checksums equal: {bool(np.array_equal(ca, cb))}")
        assert worst < 1e-4 and np.allclose(la, lb, rtol=1e-4, atol=1e-5)
    h, lh, ch, eng = run(folder, cupy, dtype="float16")
    assert all(np.isfinite(lh)) and all(v.dtype == np.float16 for v in h.values())
    print(f"float16 on cupy: losses {np.round(lh, 4).tolist()}, checksum {ch.tolist()}")
    # head-only feature task on the device
    m = load_model(folder, xp=cupy)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, "head+last", last_layers=0)
    feats = np.random.default_rng(0).normal(size=(40, 32)).astype(np.float32)
    task = FeatureClassifyTask(m, feats, np.arange(40) % 3, np.arange(30), np.arange(30, 40), 8)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3)
    for s in range(20):
        eng.step(lambda s=s: task.loss(task.batch(np.arange(s % 4 * 6, s % 4 * 6 + 6))), s,
                 1e-2, 6)
    print("feature task on cupy: eval sums", task.eval_sums().tolist())
    print("ok: zo gpu check")


if __name__ == "__main__":
    main()

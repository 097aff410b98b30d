"""Host offload (ZO2's schedule, ``zo.offload = "host"``) against the resident streamed step,
and the largest model that runs a ZO step with and without offload.

    python bench/zo_offload.py --device gpu [--layers 32 --hidden 4096 ...] [--largest]
    python bench/zo_offload.py --device cpu            # the simulated device, small sizes

Model: a Llama-shaped decoder built in memory (no files: ``--hidden``, ``--layers``,
``--intermediate``, ``--heads``, ``--kv-heads``, ``--vocab``; default on a GPU the shape of
Llama-2-7B / OPT-6.7B, 6.7B parameters, the size class ZO2 and MeZO report), weights drawn
once per distinct shape (seed 0) and copied into every layer, stored as ``--dtype``
(default bfloat16 on a GPU, float32 on the CPU). Full-parameter ZO (every tensor trainable,
as MeZO), the next-token loss on a batch of ``--batch`` random sequences of ``--length``
tokens, the block-streamed schedule (two parameter passes per step).

Printed figures (the peer is semzo's own resident step: ZO2 claims offload costs no extra
time, and neither ZO2 nor MeZO runs here):

1. the resident streamed step (``offload = "none"``) and the offloaded step (``"host"``:
   parameters in pinned host memory, each stage uploaded on a copy stream while the previous
   computes, written back on a second stream), median of ``--reps`` after a warm-up, and
   ``offloaded / resident = R`` (goal <= 1.10 for a model that fits);
2. the device memory each needs: on a GPU the high-water mark of CuPy's memory pool (freed
   before each case; an upper bound of the peak, fragmentation included), and the offloaded
   case's stage slots (``HostStore.device_bytes``); on the CPU the slots only;
3. whether the parameters after the timed steps are the same bits (they must be: the test
   suite checks it; here it is reported, not assumed);
4. ``--largest``: the deepest model of the same width that runs one warm-up and one timed
   step, resident (limited by device memory) and offloaded (limited by host memory: pinned
   parameters plus one source layer), found from the free memory and one layer's bytes, each
   try shrinking by 15 % on an out-of-memory error (at most ``--tries``; ``--max-layers``
   caps the depth; ``--largest-batch`` and ``--largest-length`` the batch).
5. ``--device-limit-gib G``: the device's memory capped at G GiB (CuPy's memory-pool limit:
   a resident allocation past it raises CuPy's out-of-memory error), so that ``--largest``
   shows a model larger than the device running offloaded on a machine whose host memory is
   smaller than its GPU's (the H200 of the GPU kit: 128 GiB of host memory, 139 GiB on the
   GPU), as on a 24-GiB or 40-GiB GPU. On the CPU (the simulated device) a resident model
   whose parameters exceed G GiB raises MemoryError before it is built: a rehearsal of the
   search, not a measurement.

``--json FILE`` appends one JSON line per case (tools/gpu-bench.py reads them).
"""

from __future__ import annotations  # noqa: I001 (semzo is imported before numpy)

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import semzo  # noqa: F401  (before numpy: the thread-pool defaults)
import numpy as np

GPU_SHAPE = {"hidden": 4096, "layers": 32, "intermediate": 11008, "heads": 32, "kv_heads": 32,
             "vocab": 32000}
CPU_SHAPE = {"hidden": 128, "layers": 6, "intermediate": 352, "heads": 4, "kv_heads": 2,
             "vocab": 1024}
SYNTHETIC = Path("<synthetic llama>")


def llama_config(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                 vocab: int) -> dict:
    """A Llama config.json as a dict (untied head, as Llama-2-7B)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False}


def shape_bytes(cfg: dict, dtype: str) -> tuple[int, int, int]:
    """(bytes of one transformer block, bytes of everything else, parameter count) of
    ``cfg`` stored as ``dtype``."""
    from semzo.model import families
    from semzo.model.causal import expected_tensors
    from semzo.model.storage import STORAGE

    fam = families.find(cfg)
    spec = families.read_spec(fam, cfg, SYNTHETIC / "config.json")
    item = STORAGE[dtype].itemsize
    block = other = count = 0
    for _name, shape, stage in expected_tensors(spec, fam.PREFIXES[0]):
        n = int(np.prod(shape))
        count += n
        if stage == 1:
            block += n * item
        elif stage == 0 or stage == spec.num_layers + 1:
            other += n * item
    return block, other, count


def synthetic_model(cfg: dict, xp, dtype: str, host_params: bool, alias: bool):
    """A :class:`~semzo.model.causal.CausalLM` of ``cfg`` with N(0, 0.02) weights (norms 1),
    drawn once per (shape, kind) and copied into each tensor. ``host_params``: NumPy arrays
    (the offloaded run); else arrays on ``xp``. ``alias``: host tensors of one shape share one
    array (only where something copies them before any write: HostStore pins every tensor
    into its own buffer on a GPU)."""
    from semzo.model import families
    from semzo.model.causal import CausalLM, expected_tensors
    from semzo.model.storage import STORAGE, to_storage

    fam = families.find(cfg)
    spec = families.read_spec(fam, cfg, SYNTHETIC / "config.json")
    prefix = fam.PREFIXES[0]
    rng = np.random.default_rng(0)
    src: dict = {}
    params = {}
    for name, shape, _stage in expected_tensors(spec, prefix):
        norm = len(shape) == 1
        key = (shape, norm)
        if key not in src:
            v = np.ones(shape, np.float32) if norm else \
                rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            src[key] = np.ascontiguousarray(to_storage(v, STORAGE[dtype]))
            del v
        a = src[key]
        if host_params:
            params[name] = a if alias else a.copy()
        else:
            params[name] = xp.array(a)            # a device copy of its own (or a host copy)
    return CausalLM(spec, params, {}, set(), xp, dtype, SYNTHETIC, prefix)


class Device:
    def __init__(self, kind: str, limit_bytes: int = 0) -> None:
        self.gpu = kind == "gpu"
        self.limit = int(limit_bytes)        # 0: the whole device
        if self.gpu:
            import cupy
            self.xp = cupy
            if self.limit:
                cupy.get_default_memory_pool().set_limit(size=self.limit)
        else:
            self.xp = np

    def unlimit(self) -> None:
        """Lift the memory cap (CuPy's pool limit is the process's)."""
        if self.gpu and self.limit:
            self.xp.get_default_memory_pool().set_limit(size=0)

    def sync(self) -> None:
        if self.gpu:
            self.xp.cuda.Device().synchronize()

    def reset(self) -> None:
        """Free what earlier cases left (so the pool's high-water mark is this case's)."""
        gc.collect()
        if self.gpu:
            self.sync()
            self.xp.get_default_memory_pool().free_all_blocks()
            self.xp.get_default_pinned_memory_pool().free_all_blocks()

    def pool_bytes(self) -> int:
        return int(self.xp.get_default_memory_pool().total_bytes()) if self.gpu else 0

    def free_bytes(self) -> int:
        """Free device memory (GPU), else available host memory; at most what the limit
        leaves."""
        if self.gpu:
            free = int(self.xp.cuda.Device().mem_info[0])
            if self.limit:
                free = min(free, self.limit - int(self.xp.get_default_memory_pool().total_bytes()))
            return free
        return min(host_available(), self.limit) if self.limit else host_available()


def host_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _topology():
    from mpi4py import MPI

    from semzo.deck import TopologySection
    from semzo.topology import build_topology
    return build_topology(MPI.COMM_SELF, TopologySection())


def checksum(dev: Device, tensors) -> list[int]:
    """The first two (exact, order-independent) words of the replica checksum; on a GPU each
    host tensor is summed on the device (the words add modulo 2**64 across tensors), which
    is far faster than NumPy over host memory."""
    from semzo.zo.engine import param_checksum
    if not dev.gpu:
        return [int(x) for x in param_checksum(tensors)[:2]]
    s = [0, 0]
    for z in tensors:
        a = dev.xp.asarray(z.array) if isinstance(z.array, np.ndarray) else z.array
        c = param_checksum([z._replace(array=a)])
        s = [(s[0] + int(c[0])) % 2**64, (s[1] + int(c[1])) % 2**64]
    return s


def run_case(dev: Device, cfg: dict, args, offload: bool, steps: int, warm: int,
             batch: int, length: int, check: bool = True) -> dict:
    """Build the model, run ``warm`` + ``steps`` streamed steps; times, memory and (``check``)
    the checksum after the pending update is applied."""
    from semzo.tasks.lm import LMTask
    from semzo.zo.engine import ZOEngine
    from semzo.zo.offload import HostStore
    from semzo.zo.perturb import ztensors
    from semzo.zo.streamed import step_streamed
    dev.reset()
    if dev.limit and not dev.gpu and not offload:      # the CPU rehearsal of a capped device
        need = sum(shape_bytes(cfg, args.dtype)[:2])
        if need > dev.limit:
            raise MemoryError(f"simulated device limit: {_gib(need)} of parameters > "
                              f"{_gib(dev.limit)}")
    t0 = time.perf_counter()
    m = synthetic_model(cfg, dev.xp, args.dtype, host_params=offload and dev.gpu,
                        alias=offload and dev.gpu)
    rng = np.random.default_rng(1)
    n = batch * (warm + steps)
    seqs = [rng.integers(3, cfg["vocab_size"], size=length).astype(np.int64) for _ in range(n)]
    task = LMTask(m, seqs, np.zeros(n, np.int64), np.arange(n), np.arange(0), 0, batch)
    names = [nm for nm, _ in m.named_parameters()]
    eng = ZOEngine(ztensors([(nm, m.params[nm]) for nm in names]), _topology(), eps=1e-3,
                   schedule="streamed", dist=args.dist)
    if offload:
        eng.store = HostStore(m, task, eng, device="gpu" if dev.gpu else "cpu")
    dev.sync()
    build_s = time.perf_counter() - t0
    times, losses = [], []
    for s in range(warm + steps):
        b = task.batch(np.arange(s * batch, (s + 1) * batch))
        dev.sync()
        t1 = time.perf_counter()
        r = step_streamed(eng, task, b, s, args.lr, batch)
        eng.store.sync()
        dev.sync()
        if s >= warm:
            times.append(time.perf_counter() - t1)
        losses.append(float(r.lp))
    ck = None
    if check:
        eng.flush()
        dev.sync()
        ck = checksum(dev, eng.tensors)
    n_params = sum(int(np.prod(a.shape)) for a in m.params.values())
    out = {"offload": offload, "layers": cfg["num_hidden_layers"], "params": n_params,
           "step_s": statistics.median(times), "steps": steps, "build_s": build_s,
           "pool_bytes": dev.pool_bytes(),
           "slot_bytes": eng.store.device_bytes() if offload else 0,
           "param_bytes": sum(int(a.nbytes) for a in m.params.values()),
           "checksum": ck, "loss_first": losses[0], "batch": f"{batch}x{length}",
           "device_limit_bytes": dev.limit}
    del eng, task, m
    dev.reset()
    return out


def _is_oom(exc: BaseException) -> bool:
    from semzo.zo.offload import DeviceMemoryError
    name = type(exc).__name__
    return isinstance(exc, (MemoryError, DeviceMemoryError)) or "OutOfMemory" in name or \
        "MemoryAllocation" in str(exc) or "out of memory" in str(exc).lower()


def largest(dev: Device, args, shape: dict, offload: bool) -> dict:
    """The deepest model of ``shape``'s width that runs a step (see the module docstring)."""
    block, other, _ = shape_bytes(llama_config(**{**shape, "layers": 1}), args.dtype)
    dev.reset()
    if offload and dev.gpu:
        # pinned copies of every tensor + the unpinned sources (one block + the rest)
        room = int(host_available() * args.host_fraction) - 2 * other - block
    elif offload:
        room = int(host_available() * args.host_fraction) - other
    elif dev.gpu:
        room = int(dev.free_bytes() * args.device_fraction) - other
    else:                          # the simulated device: host memory, or the limit
        room = int(dev.free_bytes() * args.host_fraction) - other
    layers = max(1, min(args.max_layers, room // max(block, 1)))
    tried = []
    for _ in range(args.tries):
        cfg = llama_config(**{**shape, "layers": layers})
        try:
            r = run_case(dev, cfg, args, offload, 1, 1, args.largest_batch, args.largest_length,
                         check=False)
            r["tried"] = tried
            return r
        except Exception as exc:   # out of memory: shrink; anything else: raise
            if not _is_oom(exc):
                raise
            tried.append(f"{layers} layers: {type(exc).__name__}")
            dev.reset()
            if layers == 1:
                break
            layers = max(1, int(layers * 0.85))
    return {"offload": offload, "error": "no depth ran", "tried": tried}


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    for k in ("hidden", "layers", "intermediate", "heads", "kv-heads", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default), float32 (CPU)")
    ap.add_argument("--dist", default="gaussian")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-7)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: the default)")
    ap.add_argument("--largest", action="store_true")
    ap.add_argument("--no-compare", action="store_true", help="only --largest")
    ap.add_argument("--max-layers", type=int, default=None)
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--largest-batch", type=int, default=2)
    ap.add_argument("--largest-length", type=int, default=64)
    ap.add_argument("--device-fraction", type=float, default=0.88)
    ap.add_argument("--host-fraction", type=float, default=0.80)
    ap.add_argument("--device-limit-gib", type=float, default=0.0,
                    help="cap the device's memory (see the module docstring)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.device_limit_gib < 0:
        ap.error("--device-limit-gib must be >= 0")
    dev = Device(args.device, int(args.device_limit_gib * 2 ** 30))
    try:
        return _run(dev, args)
    finally:
        dev.unlimit()          # the process may go on (tools/gpu-bench.py runs main in-process)


def _run(dev: Device, args) -> list[dict]:
    if args.threads:
        from semzo.backend import set_threads
        from semzo.model import set_threads as split_forwards
        set_threads(args.threads)
        split_forwards(args.threads)
    base = GPU_SHAPE if dev.gpu else CPU_SHAPE
    shape = {k: (getattr(args, k) if getattr(args, k) is not None else v)
             for k, v in base.items()}
    args.dtype = args.dtype or ("bfloat16" if dev.gpu else "float32")
    args.batch = args.batch or (16 if dev.gpu else 4)
    args.length = args.length or (128 if dev.gpu else 16)
    if args.max_layers is None:
        args.max_layers = 400 if dev.gpu else 8
    cfg = llama_config(**shape)
    block, other, count = shape_bytes(cfg, args.dtype)
    print(f"model: Llama-shaped, hidden {shape['hidden']}, {shape['layers']} layers, "
          f"intermediate {shape['intermediate']}, {shape['heads']} heads ({shape['kv_heads']} "
          f"kv), vocab {shape['vocab']}: {count / 1e9:.3f}B parameters, {args.dtype} "
          f"({_gib(block)} per block, {_gib(other)} embeddings + head); device "
          f"{args.device}; batch {args.batch} x {args.length}; z {args.dist}"
          + (f"; device memory capped at {_gib(dev.limit)}" if dev.limit else ""), flush=True)
    recs = []
    if not args.no_compare:
        res = run_case(dev, cfg, args, False, args.reps, 1, args.batch, args.length)
        off = run_case(dev, cfg, args, True, args.reps, 1, args.batch, args.length)
        same = res["checksum"] == off["checksum"]
        print(f"resident streamed step:  {res['step_s']:.4f} s; device pool high-water "
              f"{_gib(res['pool_bytes'])} (parameters {_gib(res['param_bytes'])})")
        print(f"offloaded streamed step: {off['step_s']:.4f} s; device pool high-water "
              f"{_gib(off['pool_bytes'])} (stage slots {_gib(off['slot_bytes'])}; parameters "
              f"in host memory {_gib(off['param_bytes'])})")
        ratio = off["step_s"] / res["step_s"]
        print(f"offloaded / resident = {ratio:.3f} (goal <= 1.10)")
        print(f"parameters after {args.reps + 1} steps: "
              f"{'the same bits' if same else 'DIFFERENT bits'} (checksums {res['checksum']} "
              f"and {off['checksum']})")
        recs.append({"case": "offload_vs_resident", "resident": res, "offloaded": off,
                     "ratio": ratio, "same_bits": same})
    if args.largest:
        for offload in (False, True):
            r = largest(dev, args, shape, offload)
            what = "offloaded" if offload else "resident"
            if "error" in r:
                print(f"largest {what}: {r['error']} ({'; '.join(r['tried'])})")
            else:
                print(f"largest {what}: {r['layers']} layers, {r['params'] / 1e9:.3f}B "
                      f"parameters ({_gib(r['param_bytes'])}), step {r['step_s']:.3f} s at "
                      f"batch {r['batch']}; device pool high-water {_gib(r['pool_bytes'])}"
                      + (f"; tried first: {'; '.join(r['tried'])}" if r["tried"] else ""))
            recs.append({"case": f"largest_{what}", **r})
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    return recs


if __name__ == "__main__":
    main(sys.argv[1:])

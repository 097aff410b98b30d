"""Where the streamed schedule finds each stage's parameters (``zo.offload``).

* :class:`ResidentStore` (``offload = "none"``): every parameter stays in the model's arrays.
* :class:`HostStore` (``offload = "host"``): the parameters live in host memory (pinned on a
  GPU); the device holds the first stage (embeddings), the last (final norm and head) and two
  block slots. Stage k is uploaded into its slot (a copy stream on the GPU), stage k+1 is
  prefetched into the other slot while stage k computes both branches (double buffering), the
  two parameter passes run on the device copy (the deferred update included), and the stage is
  written back to host memory after the - branch (a second stream on the GPU). While a stage
  is on the device the model's ``params`` entries point at the device copies
  (``model.bind_params``); afterwards at the host arrays again.

  With ``run.device = "cpu"`` the device is simulated: ``xp = numpy``, separate slot buffers,
  explicit copies in the same order, the same scheduler. It is there to test the scheduler:
  parameters must come out bit-identical to ``offload = "none"`` (tests/test_zo_streamed.py);
  it saves no memory (it costs two extra stage copies) and runs slower.

Peak device memory with ``host``: stage 0 + last stage + 2 blocks (+ reference copies of their
trainable tensors with ``zo.restore = "copy"``) + the activations of both branches
(:meth:`HostStore.device_bytes`). Running out of device memory raises one line with the bytes
needed and the bytes free.
"""

from __future__ import annotations

import numpy as np

from ..runtime import EXIT_FAILURE, SemzoError
from .perturb import ZTensor, tensor_index


class DeviceMemoryError(SemzoError):
    """The device cannot hold what the offloaded schedule needs (one line: needed, free)."""

    exit_code = EXIT_FAILURE


class ResidentStore:
    """Every parameter resident in the model's own arrays: every hook is a no-op."""

    offloads = False

    def acquire(self, k: int, idx: list[int]):
        return None

    def release(self, k: int, idx: list[int], dirty: bool = True) -> None:
        pass

    def finish(self) -> None:
        pass

    def sync(self) -> None:
        pass


class HostStore:
    """Stages streamed between host arrays and device slots (see the module docstring).

    model: the model (its ``params`` are the host arrays when this is built); task: gives the
    stages (``stage_count``, ``stage_params``); engine: the :class:`~.engine.ZOEngine` whose
    ``tensors`` (and ``ref``) are the host arrays; device: "cpu" (simulated) or "gpu" (CuPy).
    """

    offloads = True      # a forward outside the ZO step must stream the stages (evaluation)

    def __init__(self, model, task, engine, device: str = "cpu") -> None:

        self.model, self.task, self.engine = model, task, engine
        self.gpu = device == "gpu"
        if self.gpu:
            import cupy  # device = gpu only
            self.xp = cupy
            self.up = cupy.cuda.Stream(non_blocking=True)
            self.down = cupy.cuda.Stream(non_blocking=True)
        else:
            self.xp = np
        self.n = task.stage_count()
        self.names = [list(task.stage_params(k)) for k in range(self.n)]
        self.host = {nm: model.params[nm] for names in self.names for nm in names}
        if self.gpu:
            self._pin()
        pos = {z.t: i for i, z in enumerate(engine.tensors)}
        self.name_of = {}
        for names in self.names:
            for nm in names:
                i = pos.get(tensor_index(nm))
                if i is not None:
                    self.name_of[i] = nm
        if self.gpu:                      # the engine's tensors (and references): host arrays
            import cupyx  # device = gpu only
            for i, nm in self.name_of.items():
                engine.tensors[i] = engine.tensors[i]._replace(array=self.host[nm])
                if engine.copy:
                    r = engine.ref[i].array
                    pinned = cupyx.empty_pinned(r.shape, r.dtype)
                    pinned[...] = r.get() if hasattr(r, "get") else r
                    engine.ref[i] = engine.ref[i]._replace(array=pinned)
        self.slots: dict = {}            # slot key -> {name: device array}
        self.on_device: dict = {}        # stage -> (slot key, arrays, ref arrays)
        self.events: dict = {}           # slot key -> event after its last use (GPU)
        self.uploads = 0                 # stage uploads so far (tests, bench)

    # ------------------------------------------------------------------ slots
    def slot_of(self, k: int):
        return "first" if k == 0 else "last" if k == self.n - 1 else k % 2

    def _alloc(self, key, names: list[str], ref: bool):
        """Device arrays for ``names`` in slot ``key`` (reused when the shapes match)."""
        sig = tuple((tuple(self.host[n].shape), str(self.host[n].dtype)) for n in names)
        have = self.slots.get((key, ref))
        if have is not None and have[0] == sig:
            return dict(zip(names, have[1]))
        if have is not None and self.gpu:
            self.down.synchronize()                    # its last write-back has read it
            self.slots.pop((key, ref))
        try:
            arrs = self.model.alloc_stage(names, self.xp) if not ref else \
                {n: self.xp.empty(self.host[n].shape, self.host[n].dtype) for n in names}
        except Exception as exc:                       # cupy OutOfMemoryError
            if "OutOfMemory" not in type(exc).__name__:
                raise
            need = sum(int(self.host[n].nbytes) for n in names)
            free = self.xp.cuda.Device().mem_info[0]
            raise DeviceMemoryError(
                f"zo.offload = \"host\": the device is out of memory: stage slot {key} needs "
                f"{need / 2**20:.1f} MiB more, {free / 2**20:.1f} MiB free") from None
        if self.gpu:
            # the pool hands out memory in the current stream's order: kernels queued there
            # may still use it, so the copy stream starts writing only after them
            ev = self.xp.cuda.Event()
            ev.record(self.xp.cuda.get_current_stream())
            self.up.wait_event(ev)
        self.slots[(key, ref)] = (sig, [arrs[n] for n in names])
        return arrs

    def _pin(self) -> None:
        import cupyx  # device = gpu only
        for nm, a in list(self.host.items()):
            pinned = cupyx.empty_pinned(a.shape, a.dtype)
            pinned[...] = a.get() if hasattr(a, "get") else a
            self.host[nm] = pinned
            self.model.params[nm] = pinned

    def _copy_in(self, dst, src) -> None:
        if self.gpu:
            dst.set(src, stream=self.up)
        else:
            np.copyto(dst, src)

    def _copy_out(self, dst, src) -> None:
        if self.gpu:
            # blocking=False: CuPy's get() otherwise synchronizes the copy stream, and with it
            # (through the event the stream waits on) the branch compute of this stage, so the
            # host could not queue the next stage's work while this one is written back. The
            # host array is read only after sync() (end of step) or by a later upload that
            # waits on this slot's event.
            src.get(stream=self.down, out=dst, blocking=False)
        else:
            np.copyto(dst, src)

    def _upload(self, k: int) -> None:
        if k in self.on_device or not 0 <= k < self.n:
            return
        key = self.slot_of(k)
        for other, (okey, _, _) in list(self.on_device.items()):
            if okey == key:                            # the slot's previous stage must be gone
                raise RuntimeError(f"offload: stage {k} needs slot {key} held by stage {other}")
        names = self.names[k]
        if self.gpu and key in self.events:
            self.up.wait_event(self.events[key])       # the slot's last users are done
        arrs = self._alloc(key, names, ref=False)
        for nm in names:
            self._copy_in(arrs[nm], self.host[nm])
        refs = None
        if self.engine.copy:
            tr = [i for i, nm in self.name_of.items() if nm in set(names)]
            rnames = [self.name_of[i] for i in tr]
            rarr = self._alloc(key, rnames, ref=True)
            refs = {}
            for i in tr:
                nm = self.name_of[i]
                self._copy_in(rarr[nm], self.engine.ref[i].array)
                refs[i] = rarr[nm]
        if self.gpu:
            ev = self.xp.cuda.Event()
            ev.record(self.up)
            self.events[("up", k)] = ev
        self.on_device[k] = (key, arrs, refs)
        self.uploads += 1

    # ------------------------------------------------------------------ the scheduler's hooks
    def acquire(self, k: int, idx: list[int]):
        """Stage k on the device and bound in the model; prefetch stage k+1. Returns (device
        ZTensors of ``idx``, device reference ZTensors or None)."""
        self._upload(k)
        if k + 1 < self.n and self.slot_of(k + 1) not in {v[0] for v in self.on_device.values()}:
            self._upload(k + 1)
        _key, arrs, refs = self.on_device[k]
        ev = self.events.pop(("up", k), None)
        if ev is not None:
            self.xp.cuda.get_current_stream().wait_event(ev)
        self.model.bind_params(arrs)
        tens = [self.engine.tensors[i]._replace(array=arrs[self.name_of[i]]) for i in idx]
        rts = [ZTensor(self.engine.ref[i].t, refs[i], self.engine.ref[i].offset,
                       self.engine.ref[i].decay) for i in idx] if refs is not None else None
        return tens, rts

    def release(self, k: int, idx: list[int], dirty: bool = True) -> None:
        """Write stage k's trainable tensors (and references) back to host memory (the second
        stream on the GPU) and point the model at the host arrays again."""
        if k not in self.on_device:
            return
        key, arrs, refs = self.on_device.pop(k)
        if self.gpu:
            done = self.xp.cuda.Event()
            done.record(self.xp.cuda.get_current_stream())
            self.down.wait_event(done)
        if dirty:
            for i in idx:
                self._copy_out(self.host[self.name_of[i]], arrs[self.name_of[i]])
                if refs is not None:
                    self._copy_out(self.engine.ref[i].array, refs[i])
        if self.gpu:
            ev = self.xp.cuda.Event()
            ev.record(self.down)
            self.events[key] = ev
        self.model.bind_params({nm: self.host[nm] for nm in self.names[k]})

    def finish(self) -> None:
        """End of a step: every stage written back, the model bound to the host arrays."""
        for k in list(self.on_device):
            self.release(k, [], dirty=False)
        self.sync()

    def sync(self) -> None:
        if self.gpu:
            self.up.synchronize()
            self.down.synchronize()

    def device_bytes(self) -> int:
        """Bytes of the device slots allocated so far (parameters and references)."""
        return sum(int(a.nbytes) for _, arrs in self.slots.values() for a in arrs)

"""The stage protocol of a model (see :mod:`semzo.model.base`, "The stage contract"): a
model runs as ``n_stages = num_layers + 2`` stages, so that the block-streamed ZO schedule and
offloading can run, perturb and move one stage at a time. :class:`StagedModel` holds the
methods every model shares (:class:`~semzo.model.base.TransformerBase` derives from it); a
model implements ``_base_stage`` and ``_stage_run``.
"""

from __future__ import annotations

import numpy as np

from semzo.model.kernels import run_slices, split_slices


class StageState:
    """One batch between stages (:meth:`TransformerBase.stage_start` makes it).

    ``parts``: one dict per row block (CPU forward passes with ``set_threads(n > 1)`` run row
    blocks concurrently, exactly as :meth:`TransformerBase.hidden_states` does), each with the
    block's inputs and its residual stream; ``slices`` the row blocks; ``stage`` the next stage
    to run. Scratch buffers (``part["bufs"]``) are shared with states made by :meth:`fork`, so a
    second branch costs only its residual stream (B*T*H values, twice for a decoder).
    """

    def __init__(self, ids, maskf, slices: list[slice], parts: list[dict]) -> None:
        self.ids, self.maskf, self.slices, self.parts = ids, maskf, slices, parts
        self.stage = 0

    @property
    def hidden(self):
        """Final hidden states (B, T, H) once the last stage has run."""
        outs = [p.get("out") for p in self.parts]
        if any(o is None for o in outs):
            raise RuntimeError(f"the last stage has not run (next stage {self.stage})")
        if len(outs) == 1:
            return outs[0]
        return np.concatenate(outs, axis=0)

    def fork(self) -> StageState:
        """A copy with its own residual streams and shared scratch buffers."""
        parts = []
        for p in self.parts:
            q = dict(p)
            for k in ("x", "pend", "out"):
                if q.get(k) is not None:
                    q[k] = q[k].copy()
            parts.append(q)
        st = StageState(self.ids, self.maskf, self.slices, parts)
        st.stage = self.stage
        return st

    def nbytes_live(self) -> int:
        """Bytes of this state's own arrays (what a second branch adds; views counted once)."""
        seen, tot = set(), 0
        for p in self.parts:
            for k in ("x", "pend", "out"):
                a = p.get(k)
                if a is None:
                    continue
                base = a if a.base is None else a.base
                if id(base) not in seen:
                    seen.add(id(base))
                    tot += int(base.nbytes)
        return tot


class StagedModel:
    """The stage methods of a model (needs ``params``, ``lora``, ``config``, ``xp``,
    ``weight_name``, ``_inputs`` and ``split_min_tokens`` from the model class)."""

    #: the loss reads stage 0's embedding matrix (tied LM head); see the module docstring
    tied_head = False

    @property
    def n_stages(self) -> int:
        """num_layers + 2: embeddings, each block, final norm and head."""
        return self.config.num_layers + 2

    def _base_stage(self, name: str) -> int | None:
        """Stage of a checkpoint tensor name, None for names of no stage (-> the last)."""
        raise NotImplementedError

    def stage_of(self, name: str) -> int:
        """The stage that reads parameter ``name`` (LoRA A/B: the block of their projection;
        ``classifier.*``, ``lm_head.weight`` and unknown names: the last stage)."""
        if name not in self.params:
            raise KeyError(f"no parameter {name!r}")
        for spec_mod, spec in self.lora.items():
            if name in (spec.a, spec.b):
                k = self._base_stage(self.weight_name(spec_mod))
                return self.n_stages - 1 if k is None else k
        k = self._base_stage(name)
        return self.n_stages - 1 if k is None else k

    def stage_names(self, k: int) -> list[str]:
        """Names of ``params`` that stage ``k`` reads, in the collection's order."""
        self._check_stage(k)
        return [n for n in self.params if self.stage_of(n) == k]

    def _check_stage(self, k: int) -> None:
        if not 0 <= int(k) < self.n_stages:
            raise ValueError(f"stage must lie in [0, {self.n_stages}), got {k}")

    def gather_rows(self, input_ids) -> dict:
        """``{name: sorted unique rows}`` of the parameters that stage 0 reads only at the rows
        ``input_ids`` index (the token embedding matrix), for a batch of those ids. A ZO pass
        may defer the other rows' perturbations (zo/streamed.py); a task whose loss reads
        such a matrix otherwise (a tied LM head) must add the rows it reads (the prompt task's
        label words) or not ask. Empty: none."""
        return {}

    def stage_start(self, input_ids, attention_mask=None, **kwargs) -> StageState:
        """A :class:`StageState` for the batch (ids checked; no parameter read). On CPU the rows
        are cut into the blocks :meth:`hidden_states` would use at the current thread count."""
        ids, maskf = self._inputs(input_ids, attention_mask)
        bsz, t = ids.shape
        if self.xp is np:
            slices = split_slices(bsz, self.split_min_tokens, t)
        else:
            slices = [slice(0, bsz)]
        extra = {k: self.xp.asarray(v) for k, v in kwargs.items() if v is not None}
        parts = [self._stage_init(ids[sl], maskf[sl], **{k: v[sl] for k, v in extra.items()})
                 for sl in slices]
        return StageState(ids, maskf, slices, parts)

    def stage_forward(self, k: int, state: StageState) -> StageState:
        """Run stage ``k`` (the state's next stage) in place on ``state`` and return it; reads
        only the parameters of :meth:`stage_names` (k)."""
        self._check_stage(k)
        if state.stage != k:
            raise ValueError(f"stage {k} run on a state whose next stage is {state.stage}")
        by_start = {sl.start: p for sl, p in zip(state.slices, state.parts)}
        run_slices(lambda sl: self._stage_run(k, by_start[sl.start]), state.slices)
        state.stage = k + 1
        return state

    def stage_hidden_states(self, input_ids, attention_mask=None, **kwargs):
        """:meth:`hidden_states` as the composition of every stage (tests, reference)."""
        st = self.stage_start(input_ids, attention_mask, **kwargs)
        for k in range(self.n_stages):
            self.stage_forward(k, st)
        return st.hidden

    def alloc_stage(self, names: list[str], xp) -> dict:
        """Empty arrays of ``xp`` for the parameters ``names`` (a device slot of the offloaded
        schedule), laid out so that :meth:`bind_params` keeps every fast path."""
        return {n: xp.empty(self.params[n].shape, dtype=self.params[n].dtype) for n in names}

    def bind_params(self, arrays: dict) -> None:
        """Point ``params[name]`` at ``arrays[name]`` (offload: device copies, then the host
        arrays again). The arrays must have the shapes and dtypes of the current entries."""
        for n, a in arrays.items():
            old = self.params[n]
            if tuple(a.shape) != tuple(old.shape) or a.dtype != old.dtype:
                raise ValueError(f"bind_params: {n} is {old.shape} {old.dtype}, "
                                 f"got {a.shape} {a.dtype}")
            self.params[n] = a

    def _stage_init(self, ids, maskf, **kwargs) -> dict:
        b, t = ids.shape
        # "bufs": a one-element holder of the scratch buffers, shared by fork(): both
        # branches of the lockstep use one set (they never run at the same time)
        return {"ids": ids, "maskf": maskf, "b": b, "t": t, "x": None, "out": None,
                "bufs": [None], **kwargs}

    def _stage_run(self, k: int, part: dict) -> None:
        raise NotImplementedError

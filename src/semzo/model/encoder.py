"""BERT-family encoder forward pass (post-LayerNorm blocks), NumPy or CuPy.

Shapes: ids (B, T) integers, mask (B, T) 0/1; activations are kept as 2-D (B*T, features) arrays
so every projection is one GEMM. Only one layer's activations live at a time (the residual
stream (B*T, H), the fused QKV output (B*T, 3H), the attention scores (B*heads, T, T), the
attention context (B*T, H) and the feed-forward intermediate (B*T, I)); buffers are reused from
layer to layer.
"""

from __future__ import annotations

import numpy as np

from semzo.model.base import StageState, TransformerBase
from semzo.model.kernels import (
    bias_act,
    bias_residual_layernorm,
    embed_sum,
    layernorm,
    masked_softmax,
    matmul_into,
    run_split,
    split_slices,
)
from semzo.model.losses import check_ids
from semzo.model.storage import to_float32

_QKV = ("query", "key", "value")


def _length_groups(maskf) -> list[tuple[int, np.ndarray]] | None:
    """``[(L, rows of the batch whose mask is L ones then zeros), ...]``, or None when a row's
    mask is not of that form (then attention runs on the padded layout)."""
    m = np.asarray(maskf)
    lens = (m > 0).sum(axis=1)
    if not np.array_equal(m > 0, np.arange(m.shape[1])[None, :] < lens[:, None]):
        return None
    return [(int(n), np.flatnonzero(lens == n)) for n in np.unique(lens)]


def expected_names(cfg, prefix: str) -> list[str]:
    """Names of the tensors the forward pass reads, in module order."""
    e = f"{prefix}embeddings."
    names = [f"{e}word_embeddings.weight", f"{e}position_embeddings.weight",
             f"{e}token_type_embeddings.weight", f"{e}LayerNorm.weight", f"{e}LayerNorm.bias"]
    for i in range(cfg.num_layers):
        p = f"{prefix}encoder.layer.{i}."
        for m in [f"attention.self.{q}" for q in _QKV] + [
                "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                "output.dense", "output.LayerNorm"]:
            names += [f"{p}{m}.weight", f"{p}{m}.bias"]
    return names


class Encoder(TransformerBase):
    """BERT encoder. See :class:`~semzo.model.base.TransformerBase` for the parameter contract.

    The Q, K and V weights (and biases) of each layer are stored as three row blocks of one
    (3H, H) buffer; ``params`` holds the blocks under their Hugging Face names, so a fused QKV
    GEMM reads exactly the collection's current values.
    """

    kind = "encoder"
    layout = "out_in"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        xp, cfg, p = self.xp, self.config, self.params
        h = cfg.hidden_size
        self._fused: list[tuple] = []
        for i in range(cfg.num_layers):
            base = f"{self.prefix}encoder.layer.{i}.attention.self."
            # the fused buffer lives where the parameters live: host memory for a model loaded
            # with host_params (zo.offload = "host") even when xp is CuPy, whose setitem
            # refuses a NumPy source (first GPU run of the kit, 2026-11-27)
            am = np if isinstance(p[f"{base}query.weight"], np.ndarray) else xp
            w = am.empty((3 * h, h), dtype=self.param_dtype)
            b = am.empty((3 * h,), dtype=self.param_dtype)
            views = []
            for j, q in enumerate(_QKV):
                w[j * h:(j + 1) * h] = p[f"{base}{q}.weight"]
                b[j * h:(j + 1) * h] = p[f"{base}{q}.bias"]
                views.append((w[j * h:(j + 1) * h], b[j * h:(j + 1) * h]))
            for j, q in enumerate(_QKV):
                p[f"{base}{q}.weight"], p[f"{base}{q}.bias"] = views[j]
            self._fused.append((w, b, views))

    def inference_layout(self) -> bool:
        """Store the block projection weights transposed (Fortran order) for inference only.

        The forward pass multiplies by ``W.T``; with W in Fortran order that operand is
        C-contiguous, the layout OpenBLAS's sgemm reads fastest: a 16 x 64 MiniLM forward ran
        1.3 % faster at 1 thread and 2.6-4 % at 2 threads here (M = 512 rows per thread), with
        bit-identical outputs (the same kernel after packing). Names, shapes and values stay;
        only the memory order changes, so the model can no longer be trained: the ZO kernels
        refuse a tensor that is not C-contiguous (``docs/model.md``). The embed stage uses it.
        NumPy float32 storage only; returns False (and changes nothing) otherwise."""
        if self.xp is not np or self.param_dtype != np.float32 or self.lora:
            return False
        p, h = self.params, self.config.hidden_size
        for i, (w, b, views) in enumerate(self._fused):
            base = f"{self.prefix}encoder.layer.{i}."
            if any(p[f"{base}attention.self.{q}.weight"] is not views[j][0]
                   for j, q in enumerate(_QKV)):
                raise RuntimeError(f"{base}attention.self: a Q/K/V weight was replaced; "
                                   "inference_layout needs the fused buffer")
            wf = np.asfortranarray(w)
            nv = [(wf[j * h:(j + 1) * h], views[j][1]) for j in range(3)]
            for j, q in enumerate(_QKV):
                p[f"{base}attention.self.{q}.weight"] = nv[j][0]
            self._fused[i] = (wf, b, nv)
            for mod in ("attention.output.dense", "intermediate.dense", "output.dense"):
                p[f"{base}{mod}.weight"] = np.asfortranarray(p[f"{base}{mod}.weight"])
        return True

    def lora_modules(self) -> list[str]:
        mods = []
        for i in range(self.config.num_layers):
            p = f"{self.prefix}encoder.layer.{i}.attention."
            mods += [f"{p}self.{q}" for q in _QKV] + [f"{p}output.dense"]
        return mods

    def _qkv(self, x, i: int, out) -> None:
        """out (N, 3H) = [q | k | v] projections of x (N, H) with biases and LoRA deltas."""
        p, h = self.params, self.config.hidden_size
        base = f"{self.prefix}encoder.layer.{i}.attention.self."
        w, b, views = self._fused[i]
        intact = all(p[f"{base}{q}.weight"] is views[j][0] and p[f"{base}{q}.bias"] is views[j][1]
                     for j, q in enumerate(_QKV))
        if intact:
            matmul_into(x, to_float32(w).T if self.storage == "bfloat16" else w.T, out)
            out += to_float32(b) if self.storage == "bfloat16" else b
        else:   # a dict entry was replaced: use whatever arrays the collection holds now
            for j, q in enumerate(_QKV):
                out[:, j * h:(j + 1) * h] = x @ self.fparam(f"{base}{q}.weight").T + \
                    self.fparam(f"{base}{q}.bias")
        for j, q in enumerate(_QKV):
            spec = self.lora.get(f"{base}{q}")
            if spec is not None:
                self._lora_add(x, spec, out[:, j * h:(j + 1) * h])

    def hidden_states(self, input_ids, attention_mask=None, token_type_ids=None):
        """Last hidden states (B, T, H) in the model dtype (float32 on CPU).

        Padded positions (mask 0) hold finite values that mean nothing.
        """
        return super().hidden_states(input_ids, attention_mask, token_type_ids=token_type_ids)

    def _hidden(self, ids, maskf, token_type_ids=None):
        bsz, t = ids.shape
        x = self._embeddings(ids, token_type_ids)
        self._blocks(x, maskf, bsz, t, 0, self.config.num_layers)
        return x.reshape(bsz, t, self.config.hidden_size)

    # --- stages (see semzo.model.base): 0 embeddings, 1 + i block i, L + 1 the head ---------
    def _base_stage(self, name: str) -> int | None:
        pre = self.prefix
        if name.startswith(f"{pre}embeddings."):
            return 0
        lay = f"{pre}encoder.layer."
        if name.startswith(lay):
            i = name[len(lay):].split(".", 1)[0]
            if i.isdigit() and int(i) < self.config.num_layers:
                return int(i) + 1
        return None

    def alloc_stage(self, names: list[str], xp) -> dict:
        """Like the base method, but Q, K and V of a layer get one (3H, H) buffer (and one
        (3H,) bias) so the fused QKV GEMM runs on the slot: the same bits as resident."""
        out = super().alloc_stage(names, xp)
        h = self.config.hidden_size
        for i in range(self.config.num_layers):
            base = f"{self.prefix}encoder.layer.{i}.attention.self."
            wn = [f"{base}{q}.weight" for q in _QKV]
            bn = [f"{base}{q}.bias" for q in _QKV]
            if not all(n in out for n in wn + bn):
                continue
            w = xp.empty((3 * h, h), dtype=self.param_dtype)
            b = xp.empty((3 * h,), dtype=self.param_dtype)
            views = [(w[j * h:(j + 1) * h], b[j * h:(j + 1) * h]) for j in range(3)]
            for j in range(3):
                out[wn[j]], out[bn[j]] = views[j]
        return out

    def bind_params(self, arrays: dict) -> None:
        """As the base method; a layer whose Q, K and V now point at the three row blocks of
        one (3H, H) buffer (and its bias at one (3H,) buffer), as :meth:`alloc_stage` lays a
        slot out, keeps the fused GEMM. The fused layout is read off the bound arrays
        themselves: the model keeps no list of slots, so a slot the offload schedule drops
        is freed once it is unbound (nothing here holds it)."""
        super().bind_params(arrays)
        p = self.params
        for i in range(self.config.num_layers):
            base = f"{self.prefix}encoder.layer.{i}.attention.self."
            cur = [(p[f"{base}{q}.weight"], p[f"{base}{q}.bias"]) for q in _QKV]
            grp = _fused_group(cur, self.config.hidden_size)
            if grp is not None:
                self._fused[i] = grp

    def _stage_run(self, k: int, part: dict) -> None:
        b, t = part["b"], part["t"]
        if k == 0:
            part["x"] = self._embeddings(part["ids"], part.get("token_type_ids"))
        elif k <= self.config.num_layers:
            bufs = part["bufs"]
            if bufs[0] is None:
                bufs[0] = self._layer_buffers(b, t)
            self._blocks(part["x"], part["maskf"], b, t, k - 1, k, bufs=bufs[0])
        else:
            part["out"] = part["x"].reshape(b, t, self.config.hidden_size)

    # --- partial forward passes: a frozen prefix of blocks computed once (finetune) ---------
    def hidden_at(self, input_ids, attention_mask, layer: int):
        """The residual stream entering block ``layer`` (0 = after the embeddings), (B, T, H)
        in the model dtype; ``hidden_from(that, mask, layer)`` finishes the forward pass."""
        self._check_layer(layer)
        ids, maskf = self._inputs(input_ids, attention_mask)

        def run(sl):
            i, m = ids[sl], maskf[sl]
            x = self._embeddings(i)
            self._blocks(x, m, i.shape[0], i.shape[1], 0, layer)
            return x.reshape(i.shape[0], i.shape[1], -1)
        return self._split(run, ids.shape[0], ids.shape[1])

    def hidden_from(self, x, attention_mask, layer: int):
        """Final hidden states (B, T, H) from ``x`` (B, T, H), the residual stream entering
        block ``layer``: blocks ``layer .. L-1`` only. ``x`` is not modified. Padded positions
        of ``x`` may hold anything finite: keys are masked, so they do not reach real tokens."""
        self._check_layer(layer)
        xp = self.xp
        x = xp.asarray(x)
        bsz, t, h = x.shape
        maskf = xp.ascontiguousarray(xp.asarray(attention_mask).astype(xp.float32))

        def run(sl):
            y = xp.array(x[sl].reshape(-1, h), dtype=self.dtype, copy=True)
            b = y.shape[0] // t
            self._blocks(y, maskf[sl], b, t, layer, self.config.num_layers)
            return y.reshape(b, t, h)
        return self._split(run, bsz, t)

    def stage_start_from(self, x, attention_mask, layer: int):
        """A :class:`~semzo.model.base.StageState` whose next stage is ``layer + 1`` (block
        ``layer``), from ``x`` (B, T, H), the residual stream entering that block (copied):
        running the remaining stages equals :meth:`hidden_from` bit for bit."""


        self._check_layer(layer)
        xp = self.xp
        x = xp.asarray(x)
        bsz, t, h = x.shape
        maskf = xp.ascontiguousarray(xp.asarray(attention_mask).astype(xp.float32))
        slices = split_slices(bsz, self.split_min_tokens, t) if xp is np else [slice(0, bsz)]
        parts = []
        for sl in slices:
            part = self._stage_init(maskf[sl], maskf[sl])
            part["ids"] = None
            part["x"] = xp.array(x[sl].reshape(-1, h), dtype=self.dtype, copy=True)
            parts.append(part)
        st = StageState(None, maskf, slices, parts)
        st.stage = layer + 1
        return st

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer <= self.config.num_layers:
            raise ValueError(f"layer must lie in [0, {self.config.num_layers}], got {layer}")

    def _split(self, run, bsz: int, t: int):


        if self.xp is not np:
            return run(slice(0, bsz))
        parts = run_split(run, bsz, self.split_min_tokens, t)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def gather_rows(self, input_ids) -> dict:
        """The word embedding matrix (see the base class)."""
        return {f"{self.prefix}embeddings.word_embeddings.weight":
                np.unique(np.asarray(input_ids))}

    def _embeddings(self, ids, token_type_ids=None):
        """Embedding sum and LayerNorm: the residual stream (B*T, H) entering block 0."""
        xp, cfg, p, pre = self.xp, self.config, self.params, self.prefix
        bsz, t = ids.shape
        e = f"{pre}embeddings."
        tt = self.fparam(f"{e}token_type_embeddings.weight")       # (type_vocab, H): small
        x = xp.empty((bsz * t, cfg.hidden_size), dtype=self.dtype)
        embed_sum(ids, p[f"{e}word_embeddings.weight"], p[f"{e}position_embeddings.weight"],
                  tt[0], x)
        if token_type_ids is not None:
            tti = _type_ids(xp, token_type_ids, ids.shape, tt.shape[0])
            x += tt[tti] - tt[0]
        layernorm(x, self.fparam(f"{e}LayerNorm.weight"), self.fparam(f"{e}LayerNorm.bias"),
                  cfg.layer_norm_eps, out=x)
        return x

    def _attention_by_length(self, qkv, groups, bsz: int, t: int, scale: float, ctx) -> None:
        """Self-attention of the texts of each length L apart, on L x L scores: the BLAS calls
        then have shapes that depend on the text alone, not on the batch's padded length T
        (OpenBLAS picks its sgemm kernel by size, so a batched (T x T) product gave a text's
        scores other last bits in another batch: docs/guide.md, "BLAS kernels"), and padded
        keys and queries cost nothing. ``groups``: :func:`_length_groups`. ctx (B, T, nh, d);
        rows of padded positions are set to 0."""
        nh, d = self.config.num_heads, self.config.head_dim
        q5 = qkv.reshape(bsz, t, 3, nh, d)
        for n_tok, idx in groups:
            if n_tok == 0:
                ctx[idx] = 0.0
                continue
            blk = q5[idx, :n_tok]                            # (g, L, 3, nh, d), a copy
            sc = np.matmul(blk[:, :, 0].transpose(0, 2, 1, 3), blk[:, :, 1].transpose(0, 2, 3, 1))
            masked_softmax(sc.reshape(-1, n_tok, n_tok), np.ones((len(idx), n_tok), np.float32),
                           scale, nh, causal=False)
            o = np.matmul(sc, blk[:, :, 2].transpose(0, 2, 1, 3))           # (g, nh, L, d)
            ctx[idx, :n_tok] = o.transpose(0, 2, 1, 3)
            if n_tok < t:
                ctx[idx, n_tok:] = 0.0

    def _blocks(self, x, maskf, bsz: int, t: int, first: int, stop: int, bufs=None) -> None:
        """Blocks ``first .. stop-1`` on the residual stream x (B*T, H), in place (``bufs``:
        scratch from :meth:`_layer_buffers` of the same shape, made here when None).

        Padding skipped (CPU): when at least :attr:`pack_min_share` of the rows are padding
        (:meth:`_pack_rows`), the projections, LayerNorms and MLP run on the real tokens only,
        packed into one matrix; attention runs on the padded layout (padded queries, keys and
        values zero, padded keys masked as before) and the packed rows are gathered back.
        Padded rows of x are then left as they are (finite: nothing reads them). A real
        token changes by float32 rounding at most (docs/guide.md, "Padding")."""
        if first >= stop:
            return
        xp, cfg, p, pre = self.xp, self.config, self.fparam, self.prefix
        n, h, nh, d = bsz * t, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        eps = cfg.layer_norm_eps
        qkv, scores, ctx, tmp, inter, scale, s4 = bufs or self._layer_buffers(bsz, t)
        rows = self._pack_rows(maskf) if xp is np else None
        if rows is not None and not len(rows):
            return                                  # padding only: nothing to compute
        if rows is None:
            xr, qkv_r = x, qkv
        else:
            xr = x[rows]
            qkv_r = xp.empty((xr.shape[0], 3 * h), dtype=qkv.dtype)
            pad = np.ones(n, bool)
            pad[rows] = False
            qkv[pad] = 0.0                          # padded q, k, v: zero for every layer
        nr = xr.shape[0]
        tmp_r, inter_r = tmp[:nr], inter[:nr]
        groups = _length_groups(maskf) if xp is np else None
        for i in range(first, stop):
            pl = f"{pre}encoder.layer.{i}."
            self._qkv(xr, i, qkv_r)
            if rows is not None:
                qkv[rows] = qkv_r
            if groups is not None:
                self._attention_by_length(qkv, groups, bsz, t, scale, ctx)
            else:
                q5 = qkv.reshape(bsz, t, 3, nh, d)
                matmul_into(q5[:, :, 0].transpose(0, 2, 1, 3),
                            q5[:, :, 1].transpose(0, 2, 3, 1), s4)
                masked_softmax(scores, maskf, scale, nh, causal=False)
                matmul_into(s4, q5[:, :, 2].transpose(0, 2, 1, 3), ctx.transpose(0, 2, 1, 3))
            c = ctx.reshape(n, h)
            if rows is not None:
                c = c[rows]
            m = f"{pl}attention.output."
            self._proj(c, f"{m}dense", tmp_r)
            bias_residual_layernorm(tmp_r, p(f"{m}dense.bias"), xr, p(f"{m}LayerNorm.weight"),
                                    p(f"{m}LayerNorm.bias"), eps, out=xr)
            self._proj(xr, f"{pl}intermediate.dense", inter_r)
            bias_act(inter_r, p(f"{pl}intermediate.dense.bias"), cfg.hidden_act)
            m = f"{pl}output."
            self._proj(inter_r, f"{m}dense", tmp_r)
            bias_residual_layernorm(tmp_r, p(f"{m}dense.bias"), xr, p(f"{m}LayerNorm.weight"),
                                    p(f"{m}LayerNorm.bias"), eps, out=xr)
        if rows is not None:
            x[rows] = xr


def _type_ids(xp, token_type_ids, shape: tuple, n_types: int):
    """token_type_ids as a flat integer array of ``xp``, checked like the token ids on every
    device (CuPy's fancy indexing does not check bounds: an id >= n_types would read past the
    type embedding table, a negative one wrap): a 2-D integer array of the ids' ``shape``,
    every id in [0, n_types). Checked on the host when given as NumPy (no device sync)."""
    tti = xp.asarray(token_type_ids)
    if tuple(tti.shape) != tuple(shape) or tti.dtype.kind not in "iu":
        raise ValueError(f"token_type_ids must be an integer array shaped as input_ids "
                         f"{tuple(shape)}, got {tuple(tti.shape)} {tti.dtype}")
    if isinstance(token_type_ids, np.ndarray):
        check_ids(np, token_type_ids, n_types, what="token type id")
    else:
        check_ids(xp, tti, n_types, what="token type id")
    return tti.reshape(-1)


def _addr(a) -> int:
    """Address of ``a[0]`` (numpy or cupy)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def _fused_group(cur: list[tuple], h: int):
    """(w, b, views) when the (weight, bias) pairs ``cur`` of Q, K, V are rows j*h .. (j+1)*h of
    one (3h, h) buffer ``w`` and one (3h,) buffer ``b`` (any memory order), else None."""
    w, b = cur[0][0].base, cur[0][1].base
    # a base that is no array is no fused buffer: CuPy's pinned host arrays (HostStore's,
    # cupyx.empty_pinned) have a PinnedMemoryPointer as their base (first GPU run, 2026-11-27)
    if not hasattr(w, "shape") or not hasattr(b, "shape") or \
            tuple(w.shape) != (3 * h, h) or tuple(b.shape) != (3 * h,):
        return None
    for j, (wj, bj) in enumerate(cur):
        if wj.base is not w or bj.base is not b or tuple(wj.shape) != (h, h) or \
                wj.strides != w.strides or _addr(wj) != _addr(w) + j * h * w.strides[0] or \
                _addr(bj) != _addr(b) + j * h * b.strides[0]:
            return None
    return w, b, list(cur)

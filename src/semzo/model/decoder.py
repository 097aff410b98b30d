"""GPT-2-family decoder forward pass (pre-LayerNorm blocks, causal attention), NumPy or CuPy.

Weights follow GPT-2's Conv1D layout (in, out), so projections are ``x @ W`` with no transpose.
Positions are 0..T-1 for every row (right padding; what ``GPT2Model`` does when it is given an
attention mask and no position ids). Only one layer's activations live at a time.
"""

from __future__ import annotations

import numpy as np

from semzo.model.base import TransformerBase
from semzo.model.kernels import (
    bias_act,
    bias_residual_layernorm,
    embed_sum,
    layernorm,
    masked_softmax,
    matmul_into,
)


def expected_names(cfg, prefix: str) -> list[str]:
    """Names of the tensors the forward pass reads, in module order."""
    names = [f"{prefix}wte.weight", f"{prefix}wpe.weight"]
    for i in range(cfg.num_layers):
        p = f"{prefix}h.{i}."
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"{p}{m}.weight", f"{p}{m}.bias"]
    names += [f"{prefix}ln_f.weight", f"{prefix}ln_f.bias"]
    return names


class Decoder(TransformerBase):
    """GPT-2 decoder. See :class:`~semzo.model.base.TransformerBase` for the parameter contract.

    The LM head is tied to ``wte.weight`` unless the checkpoint holds its own ``lm_head.weight``.
    """

    kind = "decoder"
    layout = "in_out"

    def lora_modules(self) -> list[str]:
        mods = []
        for i in range(self.config.num_layers):
            mods += [f"{self.prefix}h.{i}.attn.c_attn", f"{self.prefix}h.{i}.attn.c_proj"]
        return mods

    def _hidden(self, ids, maskf):
        """Final hidden states after ``ln_f`` (B, T, H), model dtype: the composition of the
        stages (one code path, so :meth:`stage_forward` equals it bit for bit)."""
        part = self._stage_init(ids, maskf)
        for k in range(self.n_stages):
            self._stage_run(k, part)
        return part["out"]

    # --- stages (see semzo.model.base): 0 embeddings, 1 + i block i, L + 1 ln_f and head --
    @property
    def tied_head(self) -> bool:
        """True when the LM head reads ``wte.weight`` (no ``lm_head.weight`` of its own)."""
        return "lm_head.weight" not in self.params

    def gather_rows(self, input_ids) -> dict:
        """``wte`` (see the base class; the LM head reads it too when tied)."""
        return {f"{self.prefix}wte.weight": np.unique(np.asarray(input_ids))}

    def _base_stage(self, name: str) -> int | None:
        pre = self.prefix
        if name in (f"{pre}wte.weight", f"{pre}wpe.weight"):
            return 0
        if name.startswith(f"{pre}h."):
            i = name[len(pre) + 2:].split(".", 1)[0]
            if i.isdigit() and int(i) < self.config.num_layers:
                return int(i) + 1
        return None

    def _stage_run(self, k: int, part: dict) -> None:
        """Stage k on one row block. The residual stream ``x`` and the last sub-block's output
        with its bias added (``pend``, not yet in ``x``) travel between stages, so the next
        block's ``ln_1`` (or ``ln_f``) is read by the stage it belongs to.

        Padding skipped (CPU, as :class:`~semzo.model.encoder.Encoder` and ``CausalLM``):
        when at least :attr:`pack_min_share` of the rows are padding, stage 0 packs the real
        tokens' rows (:meth:`_pack_rows`, kept in ``part["rows"]``) and ``x`` and ``pend``
        hold those rows only; attention runs on the padded layout (padded q, k, v zero,
        padded keys masked as before); the last stage writes the real rows of ``out`` and
        zeros elsewhere. A real token changes by float32 rounding at most."""
        xp, cfg, p, pre = self.xp, self.config, self.fparam, self.prefix
        bsz, t, ids, maskf = part["b"], part["t"], part["ids"], part["maskf"]
        n, h, nh, d = bsz * t, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        dt, eps = self.dtype, cfg.layer_norm_eps
        zero = xp.zeros(h, dtype=dt)
        if k == 0:
            x = xp.empty((n, h), dtype=dt)        # residual stream
            embed_sum(ids, self.params[f"{pre}wte.weight"], self.params[f"{pre}wpe.weight"],
                      zero, x)
            rows = self._pack_rows(maskf) if xp is np else None
            part["rows"] = rows
            part["x"] = x if rows is None else x[rows]
            part["pend"] = None
            return
        x, pend, rows = part["x"], part["pend"], part.get("rows")
        nr = x.shape[0]
        if k == cfg.num_layers + 1:
            out = xp.empty((nr, h), dtype=dt)
            if pend is None:
                layernorm(x, p(f"{pre}ln_f.weight"), p(f"{pre}ln_f.bias"), eps, out=out)
            else:
                bias_residual_layernorm(pend, zero, x, p(f"{pre}ln_f.weight"),
                                        p(f"{pre}ln_f.bias"), eps, out=out)
            if rows is not None:
                full = xp.zeros((n, h), dtype=dt)
                full[rows] = out
                out = full
            part["out"] = out.reshape(bsz, t, h)
            return
        if nr == 0:                               # padding only: nothing to compute
            return
        bufs = part["bufs"]
        if bufs[0] is None:
            bufs[0] = (*self._layer_buffers(bsz, t), xp.empty((n, h), dtype=dt))
        qkv, scores, ctx, tmp, inter, scale, s4, a = bufs[0]
        a, tmp, inter = a[:nr], tmp[:nr], inter[:nr]
        pl = f"{pre}h.{k - 1}."
        if pend is None:
            layernorm(x, p(f"{pl}ln_1.weight"), p(f"{pl}ln_1.bias"), eps, out=a)
        else:
            bias_residual_layernorm(pend, zero, x, p(f"{pl}ln_1.weight"), p(f"{pl}ln_1.bias"),
                                    eps, out=a)
        if rows is None:
            self._proj(a, f"{pl}attn.c_attn", qkv)
            qkv += p(f"{pl}attn.c_attn.bias")
        else:
            qkv_r = xp.empty((nr, 3 * h), dtype=dt)
            self._proj(a, f"{pl}attn.c_attn", qkv_r)
            qkv_r += p(f"{pl}attn.c_attn.bias")
            qkv[...] = 0.0                        # padded q, k, v: zero
            qkv[rows] = qkv_r
        q5 = qkv.reshape(bsz, t, 3, nh, d)
        matmul_into(q5[:, :, 0].transpose(0, 2, 1, 3), q5[:, :, 1].transpose(0, 2, 3, 1), s4)
        masked_softmax(scores, maskf, self.attn_scale(k - 1, scale), nh, causal=True)
        matmul_into(s4, q5[:, :, 2].transpose(0, 2, 1, 3), ctx.transpose(0, 2, 1, 3))
        c = ctx.reshape(n, h)
        self._proj(c if rows is None else c[rows], f"{pl}attn.c_proj", tmp)
        bias_residual_layernorm(tmp, p(f"{pl}attn.c_proj.bias"), x, p(f"{pl}ln_2.weight"),
                                p(f"{pl}ln_2.bias"), eps, out=a)
        self._proj(a, f"{pl}mlp.c_fc", inter)
        bias_act(inter, p(f"{pl}mlp.c_fc.bias"), cfg.hidden_act)
        if pend is None:
            part["pend"] = pend = xp.empty((nr, h), dtype=dt)
        self._proj(inter, f"{pl}mlp.c_proj", pend)
        pend += p(f"{pl}mlp.c_proj.bias")

    def attn_scale(self, layer: int, default: float) -> float:
        """Score scale of block ``layer``: 1/sqrt(d) (``default``), or 1 when
        ``scale_attn_weights`` is false, divided by layer + 1 with
        ``scale_attn_by_inverse_layer_idx`` (as GPT2Attention)."""
        cfg = self.config
        s = default if cfg.scale_attn_weights else 1.0
        return s / (layer + 1) if cfg.scale_attn_by_inverse_layer_idx else s

    def head_weight_name(self) -> str:
        """Name of the LM head matrix (V, H) in ``params`` (``wte.weight`` when tied)."""
        return "lm_head.weight" if "lm_head.weight" in self.params else f"{self.prefix}wte.weight"

    def _lm_weight(self):
        return self.fparam(self.head_weight_name())

    def logits(self, input_ids, attention_mask=None):
        """Next-token logits (B, T, V) in float32 (the LM head is tied to ``wte``)."""
        xp = self.xp
        hs = self.hidden_states(input_ids, attention_mask)
        bsz, t, h = hs.shape
        out = hs.reshape(bsz * t, h) @ self._lm_weight().T
        return out.astype(xp.float32, copy=False).reshape(bsz, t, -1)

    def _head_w(self):
        return self._lm_weight()

    def _head(self, hs2, w=None):
        """float32 logits (N, V) of final hidden states (N, H)."""
        w = self._lm_weight() if w is None else w
        return (hs2 @ w.T).astype(self.xp.float32, copy=False)


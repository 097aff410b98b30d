"""GPT-2-family decoder forward pass (pre-LayerNorm blocks, causal attention), NumPy or CuPy.

Weights follow GPT-2's Conv1D layout (in, out), so projections are ``x @ W`` with no transpose.
Positions are 0..T-1 for every row (right padding; what ``GPT2Model`` does when it is given an
attention mask and no position ids). Only one layer's activations live at a time.
"""

from __future__ import annotations

from semzo.model.base import TransformerBase, cross_entropy
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
        """Final hidden states after ``ln_f`` (B, T, H), model dtype."""
        xp, cfg, p, pre = self.xp, self.config, self.params, self.prefix
        bsz, t = ids.shape
        n, h, nh, d = bsz * t, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        dt, eps = self.dtype, cfg.layer_norm_eps
        x = xp.empty((n, h), dtype=dt)      # residual stream
        a = xp.empty((n, h), dtype=dt)      # normalized input of the next sub-block
        embed_sum(ids, p[f"{pre}wte.weight"], p[f"{pre}wpe.weight"], xp.zeros(h, dtype=dt), x)
        layernorm(x, p[f"{pre}h.0.ln_1.weight"], p[f"{pre}h.0.ln_1.bias"], eps, out=a)
        qkv, scores, ctx, tmp, inter, scale, s4 = self._layer_buffers(bsz, t)
        for i in range(cfg.num_layers):
            pl = f"{pre}h.{i}."
            self._proj(a, f"{pl}attn.c_attn", qkv)
            qkv += p[f"{pl}attn.c_attn.bias"]
            q5 = qkv.reshape(bsz, t, 3, nh, d)
            matmul_into(q5[:, :, 0].transpose(0, 2, 1, 3), q5[:, :, 1].transpose(0, 2, 3, 1),
                        s4)
            masked_softmax(scores, maskf, self.attn_scale(i, scale), nh, causal=True)
            matmul_into(s4, q5[:, :, 2].transpose(0, 2, 1, 3), ctx.transpose(0, 2, 1, 3))
            self._proj(ctx.reshape(n, h), f"{pl}attn.c_proj", tmp)
            bias_residual_layernorm(tmp, p[f"{pl}attn.c_proj.bias"], x, p[f"{pl}ln_2.weight"],
                                    p[f"{pl}ln_2.bias"], eps, out=a)
            self._proj(a, f"{pl}mlp.c_fc", inter)
            bias_act(inter, p[f"{pl}mlp.c_fc.bias"], cfg.hidden_act)
            self._proj(inter, f"{pl}mlp.c_proj", tmp)
            nxt = f"{pre}h.{i + 1}.ln_1" if i + 1 < cfg.num_layers else f"{pre}ln_f"
            bias_residual_layernorm(tmp, p[f"{pl}mlp.c_proj.bias"], x, p[f"{nxt}.weight"],
                                    p[f"{nxt}.bias"], eps, out=a)
        return a.reshape(bsz, t, h)

    def attn_scale(self, layer: int, default: float) -> float:
        """Score scale of block ``layer``: 1/sqrt(d) (``default``), or 1 when
        ``scale_attn_weights`` is false, divided by layer + 1 with
        ``scale_attn_by_inverse_layer_idx`` (as GPT2Attention)."""
        cfg = self.config
        s = default if cfg.scale_attn_weights else 1.0
        return s / (layer + 1) if cfg.scale_attn_by_inverse_layer_idx else s

    def _lm_weight(self):
        w = self.params.get("lm_head.weight")
        return self.params[f"{self.prefix}wte.weight"] if w is None else w

    def logits(self, input_ids, attention_mask=None):
        """Next-token logits (B, T, V) in float32 (the LM head is tied to ``wte``)."""
        xp = self.xp
        hs = self.hidden_states(input_ids, attention_mask)
        bsz, t, h = hs.shape
        out = hs.reshape(bsz * t, h) @ self._lm_weight().T
        return out.astype(xp.float32, copy=False).reshape(bsz, t, -1)

    def next_token_loss(self, input_ids, attention_mask=None, chunk: int = 256,
                        return_accuracy: bool = False):
        """Mean cross-entropy of predicting token t+1 from positions <= t (float).

        Targets at padded positions (mask 0) do not count, as with Hugging Face labels set to
        -100 there. The (rows, V) logits are computed ``chunk`` rows at a time.
        With ``return_accuracy``, returns ``(loss, accuracy)``.
        """
        xp = self.xp
        ids, maskf = self._inputs(input_ids, attention_mask)
        bsz, t = ids.shape
        hs = self.hidden_states(ids, maskf)[:, :-1].reshape(bsz * (t - 1), -1)
        tgt = ids[:, 1:].reshape(-1).astype(xp.int64)
        wt = maskf[:, 1:].reshape(-1)
        w = self._lm_weight()
        tot_l = tot_a = 0.0
        for s in range(0, hs.shape[0], chunk):
            sl = slice(s, s + chunk)
            cnt = float(wt[sl].sum())
            if cnt == 0:
                continue
            z = (hs[sl] @ w.T).astype(xp.float32, copy=False)
            lo, ac = cross_entropy(xp, z, tgt[sl], wt[sl])
            tot_l += lo * cnt
            tot_a += ac * cnt
        n = max(float(wt.sum()), 1.0)
        return (tot_l / n, tot_a / n) if return_accuracy else tot_l / n


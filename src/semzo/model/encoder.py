"""BERT-family encoder forward pass (post-LayerNorm blocks), NumPy or CuPy.

Shapes: ids (B, T) integers, mask (B, T) 0/1; activations are kept as 2-D (B*T, features) arrays
so every projection is one GEMM. Only one layer's activations live at a time (the residual
stream (B*T, H), the fused QKV output (B*T, 3H), the attention scores (B*heads, T, T), the
attention context (B*T, H) and the feed-forward intermediate (B*T, I)); buffers are reused from
layer to layer.
"""

from __future__ import annotations

from semzo.model.base import TransformerBase
from semzo.model.kernels import (
    bias_act,
    bias_residual_layernorm,
    embed_sum,
    layernorm,
    masked_softmax,
    matmul_into,
)

_QKV = ("query", "key", "value")


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
            w = xp.empty((3 * h, h), dtype=self.dtype)
            b = xp.empty((3 * h,), dtype=self.dtype)
            views = []
            for j, q in enumerate(_QKV):
                w[j * h:(j + 1) * h] = p[f"{base}{q}.weight"]
                b[j * h:(j + 1) * h] = p[f"{base}{q}.bias"]
                views.append((w[j * h:(j + 1) * h], b[j * h:(j + 1) * h]))
            for j, q in enumerate(_QKV):
                p[f"{base}{q}.weight"], p[f"{base}{q}.bias"] = views[j]
            self._fused.append((w, b, views))

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
            matmul_into(x, w.T, out)
            out += b
        else:   # a dict entry was replaced: use whatever arrays the collection holds now
            for j, q in enumerate(_QKV):
                out[:, j * h:(j + 1) * h] = x @ p[f"{base}{q}.weight"].T + p[f"{base}{q}.bias"]
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
        xp, cfg, p, pre = self.xp, self.config, self.params, self.prefix
        bsz, t = ids.shape
        n, h, nh, d = bsz * t, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        dt, eps = self.dtype, cfg.layer_norm_eps
        e = f"{pre}embeddings."
        tt = p[f"{e}token_type_embeddings.weight"]
        x = xp.empty((n, h), dtype=dt)
        embed_sum(ids, p[f"{e}word_embeddings.weight"], p[f"{e}position_embeddings.weight"],
                  tt[0], x)
        if token_type_ids is not None:
            tti = xp.asarray(token_type_ids).reshape(-1)
            x += tt[tti] - tt[0]
        layernorm(x, p[f"{e}LayerNorm.weight"], p[f"{e}LayerNorm.bias"], eps, out=x)

        qkv, scores, ctx, tmp, inter, scale, s4 = self._layer_buffers(bsz, t)
        for i in range(cfg.num_layers):
            pl = f"{pre}encoder.layer.{i}."
            self._qkv(x, i, qkv)
            q5 = qkv.reshape(bsz, t, 3, nh, d)
            matmul_into(q5[:, :, 0].transpose(0, 2, 1, 3), q5[:, :, 1].transpose(0, 2, 3, 1),
                        s4)
            masked_softmax(scores, maskf, scale, nh, causal=False)
            matmul_into(s4, q5[:, :, 2].transpose(0, 2, 1, 3), ctx.transpose(0, 2, 1, 3))
            m = f"{pl}attention.output."
            self._proj(ctx.reshape(n, h), f"{m}dense", tmp)
            bias_residual_layernorm(tmp, p[f"{m}dense.bias"], x, p[f"{m}LayerNorm.weight"],
                                    p[f"{m}LayerNorm.bias"], eps, out=x)
            self._proj(x, f"{pl}intermediate.dense", inter)
            bias_act(inter, p[f"{pl}intermediate.dense.bias"], cfg.hidden_act)
            m = f"{pl}output."
            self._proj(inter, f"{m}dense", tmp)
            bias_residual_layernorm(tmp, p[f"{m}dense.bias"], x, p[f"{m}LayerNorm.weight"],
                                    p[f"{m}LayerNorm.bias"], eps, out=x)
        return x.reshape(bsz, t, h)

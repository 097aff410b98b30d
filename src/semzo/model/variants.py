"""Pieces of the spec-driven decoder (:mod:`semzo.model.causal`) that only the later families
use, each a function of the model and its arrays (NumPy or CuPy), switched on by a
:class:`~semzo.model.spec.DecoderSpec` field:

- fused projections (Phi-3): ``qkv_proj`` writes the [q | k | v] columns in one GEMM,
  ``gate_up_proj`` the [gate | up] ones (the layout of the unfused path, so nothing else
  changes; LoRA targets the fused module, as PEFT does);
- ``qk_norm`` (Qwen3, Gemma 3): per-head RMSNorm of q and k (after their biases, before
  rotary), weights (head_dim,);
- ``norm_plus_one`` (Gemma): RMSNorm scaled by (1 + w), computed in float32 as transformers;
- ``sandwich`` (Gemma 2/3): the attention and MLP outputs are normed before the residual add;
- ``embed_scale`` (Gemma): embeddings times sqrt(hidden_size) rounded to the storage dtype
  (transformers multiplies by ``embed_scale.to(weight.dtype)``);
- ``attn_softcap`` / ``final_softcap`` (Gemma 2): ``c * tanh(x / c)`` on the scaled scores /
  the logits;
- per-layer rotary tables (Gemma 3's local base, SmolLM3's layers without rotary, Phi-3's
  partial rotary): :func:`rope_tables` caches one table per :class:`RopeSpec`.
"""

from __future__ import annotations

import numpy as np

from semzo.backend import array_module
from semzo.model.storage import STORAGE, to_float32, to_storage


def project_qkv(model, a, m: dict, qkv, nh: int, nkv: int, d: int, ab=None):
    """Write the q, k, v projections of ``a`` (N, H) into ``qkv`` (N, (nh + 2 nkv) d); return
    the biases (bq, bk, bv) still to add, or None (none, or already added: ``qk_norm``).
    ``ab``: the bfloat16 bits of a when the norm wrote them (model.matmul = "bfloat16")."""
    s, xp = model.config, model.xp
    nq, nk = nh * d, nkv * d
    if "qkv" in m:
        model._proj(a, m["qkv"], qkv, ab)
        biases = tuple(xp.split(model.fparam(m["qkv"] + ".bias"), [nq, nq + nk])) \
            if s.qkv_bias else None
    else:
        if ab is None:
            ab = model.gemm_input(a)                # bfloat16 GEMMs: a converted once
        model._proj_many(a, (m["q"], m["k"], m["v"]),
                         (qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]), ab)
        biases = tuple(model.fparam(m[r] + ".bias") for r in "qkv") if s.qkv_bias else None
    if not s.qk_norm:
        return biases
    if biases is not None:
        qkv += xp.concatenate(biases).astype(qkv.dtype, copy=False)
    for role, lo, hi in (("qnorm", 0, nq), ("knorm", nq, nq + nk)):
        part = xp.ascontiguousarray(qkv[:, lo:hi]).reshape(-1, d)
        model._norm(part, m[role], part)
        qkv[:, lo:hi] = part.reshape(qkv.shape[0], hi - lo)
    return None


def project_gate_up(model, a, m: dict, gu, ab=None):
    """Write gate and up projections of ``a`` into ``gu`` (N, 2I) = [gate | up]; return their
    biases (bg, bu) (None, None without); ``ab``: as :func:`project_qkv`."""
    s, xp, i_ = model.config, model.xp, model.config.intermediate_size
    if "gate_up" in m:
        model._proj(a, m["gate_up"], gu, ab)
        if not s.mlp_bias:
            return None, None
        return tuple(xp.split(model.fparam(m["gate_up"] + ".bias"), 2))
    if ab is None:
        ab = model.gemm_input(a)
    model._proj_many(a, (m["gate"], m["up"]), (gu[:, :i_], gu[:, i_:]), ab)
    if not s.mlp_bias:
        return None, None
    return model.fparam(m["gate"] + ".bias"), model.fparam(m["up"] + ".bias")


def post_norm(model, y, bias, mod: str):
    """``y = norm(y + bias)`` in place (a sandwich norm); returns None (the bias is spent)."""
    if bias is not None:
        y += bias
    model._norm(y, mod, y)


def plus_one(g):
    """Gemma's norm scale ``1 + w``, float32 (as ``1.0 + weight.float()``; the norm kernels
    compute in float32 and store in the activations' dtype, as transformers)."""
    return g.astype(np.float32) + np.float32(1.0)


def embed_factor(model) -> float:
    """The embedding scale as transformers applies it: sqrt(hidden_size) as a float32 tensor
    cast to the weights' dtype (bfloat16 storage: rounded to bfloat16, float16: to float16;
    the product stays in the compute dtype, float32 for bfloat16 storage)."""
    f = np.asarray([model.config.embed_scale], np.float32)
    if model.storage != "float32":
        f = to_float32(to_storage(f, STORAGE[model.storage])) if model.storage == "bfloat16" \
            else f.astype(np.float16).astype(np.float32)
    return float(f[0])


def scale_embeddings(model, x) -> None:
    """``x *= embed_factor`` in place (x: gathered embedding rows, compute dtype)."""
    x *= model.dtype.type(embed_factor(model))


def softcap(z, cap: float, scale: float = 1.0) -> float:
    """``z = cap * tanh(z * scale / cap)`` in place (transformers' order: scale, divide, tanh,
    multiply); returns the scale left to apply (1.0)."""
    xp = array_module(z)
    if scale != 1.0:
        z *= z.dtype.type(scale)
    z /= z.dtype.type(cap)
    xp.tanh(z, out=z)
    z *= z.dtype.type(cap)
    return 1.0


def rope_tables(model, n: int, rope):
    """cos, sin of ``rope`` for positions 0..n-1 (at least), cached per RopeSpec."""
    size, cos, sin = model._rope.get(rope, (0, None, None))
    if size < n:
        size = max(n, min(model.config.max_positions, 4096))
        cos, sin = rope.tables(model.config.head_dim, size)
        cos, sin = model.xp.asarray(cos), model.xp.asarray(sin)
        model._rope[rope] = (size, cos, sin)
    return cos, sin

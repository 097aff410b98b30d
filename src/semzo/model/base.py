"""What encoders and decoders share: the named parameter collection, projections with optional
LoRA deltas, pooling, and the classification head with its loss.

The parameter contract (relied on by the zeroth-order engine):

- ``model.params`` is an ordered ``dict`` name -> array, names exactly as in the Hugging Face
  checkpoint (``encoder.layer.0.attention.self.query.weight``, ``h.0.attn.c_attn.weight``, ...),
  in module order (embeddings, blocks 0..L-1, final norm, then tensors the forward pass does
  not use, then added tensors: ``classifier.*`` and LoRA ``<module>.lora_A.weight`` /
  ``<module>.lora_B.weight``). The order never depends on the file.
- Every array is C-contiguous, of the model's storage dtype ``param_dtype`` (float32, float16, or
  uint16 holding bfloat16 bits: :mod:`semzo.model.storage`), and modified in place by the caller
  (``arr += ...``, ``xp.copyto(arr, ...)``); the forward pass reads the arrays of the collection
  on every call and keeps no derived copies. (The encoder stores Q, K and V of a layer as three
  row blocks of one buffer so it can run one fused GEMM; each block is still a C-contiguous
  array of the collection. Replacing a dict entry by a new array instead of writing in place is
  detected and handled by falling back to three GEMMs.)
- ``model.frozen`` is the set of names that are not trained (tensors the forward pass does not
  use, such as the BERT pooler; the base weights after :meth:`add_lora`).
  ``model.named_parameters()`` yields the trainable ones, ``named_parameters(True)`` all.

LoRA hook: ``model.lora`` maps a projection's module name (``...attention.self.query``) to a
:class:`LoraSpec`; every projection ``y = x @ W.T (+ b)`` then adds ``(x @ A.T) @ B.T * scale``
with ``A = params[spec.a]`` (r, in) and ``B = params[spec.b]`` (out, r). :meth:`add_lora`
creates and registers them (A uniform like PEFT's Kaiming init, B zero, so the output starts
unchanged).

The stage contract (relied on by the block-streamed ZO schedule, ``zo.schedule = "streamed"``,
and by offloading): a model runs as ``n_stages = num_layers + 2`` stages, stage 0 the
embeddings, stage ``1 + i`` block i, stage ``L + 1`` the final norm and everything the loss
reads (``classifier.*``, ``lm_head.weight``). :meth:`TransformerBase.stage_names` lists the
parameters a stage reads (every name of ``params`` in exactly one stage; LoRA A/B with the block
of their projection; unused tensors such as BERT's pooler in the last stage);
:meth:`~TransformerBase.stage_start` prepares a batch (reads no parameter),
:meth:`~TransformerBase.stage_forward` runs one stage on a :class:`StageState` reading only that
stage's parameters, and after the last stage ``state.hidden`` equals :meth:`hidden_states` on
the same batch bit for bit. ``tied_head`` says the loss reads stage 0's embedding matrix (a
tied LM head): a streamed schedule must keep stage 0's perturbation live until the loss.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from semzo.model.gemm import MODES as MATMUL_MODES
from semzo.model.gemm import bf16_input, matmul_bf16, matmul_bf16_many, matmul_f32
from semzo.model.gemm_cpu import GEMV_ROWS, gemv_f32, gemv_f32_many, gemv_f32_usable
from semzo.model.kernels import matmul_into, run_slices, run_split, scratch, split_slices
from semzo.model.kernels_lm import token_nll
from semzo.model.losses import (
    TokenIdError,
    check_ids,
    check_labels,
    cross_entropy,
    cross_entropy_sums,
    mean_pool,
)
from semzo.model.spec import DecoderSpec, EncoderSpec
from semzo.model.stages import StagedModel, StageState
from semzo.model.storage import COMPUTE, STORAGE, storage_name, to_float32, to_storage

#: the block index in a parameter or module name (``layer.3.``, ``layers.3.``, GPT-2's ``h.3.``)
BLOCK = re.compile(r"(?:^|\.)(?:layers?|h)\.(\d+)\.")

# re-exported: callers import these from here
__all__ = ["HeadSpec", "LoraSpec", "StageState", "TokenIdError", "TransformerBase",
           "check_ids", "check_labels", "cross_entropy", "is_no_decay", "mean_pool"]


@dataclass(frozen=True)
class LoraSpec:
    """A low-rank delta on one projection: ``y += (x @ params[a].T) @ params[b].T * scale``."""

    a: str
    b: str
    scale: float


@dataclass(frozen=True)
class HeadSpec:
    """Classification head: mean-pooled hidden states (L2-normalized if ``normalize``) -> linear."""

    n_classes: int
    normalize: bool = False


def is_no_decay(name: str) -> bool:
    """True for tensors that MeZO-style updates exclude from weight decay (biases, norms)."""
    return name.endswith(".bias") or "LayerNorm" in name or ".ln_" in name or \
        name.startswith(("ln_", "transformer.ln_", "norm.")) or "layernorm" in name or \
        "layer_norm" in name or ".norm." in name


class TransformerBase(StagedModel):
    """Base of :class:`~semzo.model.encoder.Encoder` and :class:`~semzo.model.causal.CausalLM`.

    Attributes: ``config`` (frozen dataclass), ``xp`` (numpy or cupy), ``storage`` (the weight
    storage: "float32", "float16" or "bfloat16"), ``param_dtype`` (numpy dtype of the stored
    tensors: uint16 for bfloat16 bits), ``dtype`` (numpy dtype of activations: float16 for
    float16 storage, else float32), ``params``, ``buffers`` (non-float tensors of the checkpoint, kept for
    export), ``frozen``, ``lora``, ``head`` (:class:`HeadSpec` or None), ``source`` (the folder
    the model was read from) and ``prefix`` (checkpoint name prefix, such as ``"bert."``).
    """

    kind = "base"
    #: the projections' and the LM head's arithmetic (:meth:`set_matmul`)
    matmul = "float32"
    #: "out_in": weights are (out, in) like torch.nn.Linear; "in_out": GPT-2 Conv1D (in, out)
    layout = "out_in"

    def __init__(self, config: DecoderSpec | EncoderSpec, params: dict[str, Any],
                 buffers: dict[str, np.ndarray], frozen: set[str], xp, dtype,
                 source: Path | None, prefix: str) -> None:
        self.config = config
        self.params = params
        self.buffers = buffers
        self.frozen = set(frozen)
        self.xp = xp
        self.storage = storage_name(dtype)
        self.param_dtype = STORAGE[self.storage]
        self.dtype = COMPUTE[self.storage]
        self.source = source
        self.prefix = prefix
        self.lora: dict[str, LoraSpec] = {}
        self.head: HeadSpec | None = None

    # ------------------------------------------------------------------ parameter collection
    def named_parameters(self, include_frozen: bool = False) -> Iterator[tuple[str, Any]]:
        """(name, array) in the collection's stable order; trainable ones unless asked for all."""
        for name, arr in self.params.items():
            if include_frozen or name not in self.frozen:
                yield name, arr

    def num_parameters(self, include_frozen: bool = False) -> int:
        return sum(int(a.size) for _, a in self.named_parameters(include_frozen))

    def weight_name(self, module: str) -> str:
        return f"{module}.weight"

    def proj_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        w = self.params[self.weight_name(module)]
        return (w.shape[1], w.shape[0]) if self.layout == "out_in" else (w.shape[0], w.shape[1])

    def lora_modules(self) -> list[str]:
        """Names of the projections that accept a LoRA delta (attention projections)."""
        raise NotImplementedError

    def add_lora(self, rank: int = 8, alpha: float = 16.0, targets: tuple[str, ...] | None = None,
                 seed: int = 0, freeze_base: bool = True) -> list[str]:
        """Add LoRA adapters to the projections whose name ends with one of ``targets``.

        Creates ``<module>.lora_A.weight`` (rank, in) and ``<module>.lora_B.weight`` (out, rank)
        (B = 0, so outputs are unchanged), registers them in :attr:`lora` with scale
        ``alpha / rank`` and, with ``freeze_base``, freezes every other tensor except the
        classifier. Returns the names of the new tensors.
        """
        mods = self.lora_modules()
        if targets is not None:
            mods = [m for m in mods if m.endswith(tuple(targets))]
        if not mods:
            raise ValueError(f"no projection matches LoRA targets {targets}")
        rng = np.random.default_rng(seed)
        new: list[str] = []
        for m in mods:
            fin, fout = self.proj_shape(m)
            bound = 1.0 / math.sqrt(fin)
            a = rng.uniform(-bound, bound, size=(rank, fin))
            spec = LoraSpec(f"{m}.lora_A.weight", f"{m}.lora_B.weight", float(alpha) / rank)
            self.params[spec.a] = self.to_param(a)
            self.params[spec.b] = self.xp.zeros((fout, rank), dtype=self.param_dtype)
            self.lora[m] = spec
            new += [spec.a, spec.b]
        if freeze_base:
            keep = set(new) | {n for n in self.params if n.startswith("classifier.")}
            self.frozen |= set(self.params) - keep
        return new

    def add_classifier(self, n_classes: int, init: str = "normal", std: float = 0.02,
                       seed: int = 0, normalize: bool = False) -> None:
        """Add ``classifier.weight`` (C, H) and ``classifier.bias`` (C,) for :meth:`classify`.

        ``init``: "normal" (N(0, std), bias 0) or "zeros". ``normalize``: L2-normalize the pooled
        embedding before the linear layer.
        """
        h = self.config.hidden_size
        if init == "normal":
            w = np.random.default_rng(seed).normal(0.0, std, size=(n_classes, h))
        elif init == "zeros":
            w = np.zeros((n_classes, h))
        else:
            raise ValueError(f"unknown classifier init {init!r}")
        self.params["classifier.weight"] = self.to_param(w)
        self.params["classifier.bias"] = self.xp.zeros((n_classes,), dtype=self.param_dtype)
        self.frozen -= {"classifier.weight", "classifier.bias"}
        self.head = HeadSpec(int(n_classes), bool(normalize))

    def to_param(self, a):
        """A host float array as a new C-contiguous parameter array of this model (xp, storage
        dtype; bfloat16 rounded to nearest even from float32)."""
        a = np.asarray(a)
        a = to_storage(a.astype(np.float32) if self.storage == "bfloat16" else a,
                       self.param_dtype)
        return self.xp.ascontiguousarray(self.xp.asarray(a))

    def fparam(self, name: str):
        """Parameter ``name`` as the forward pass reads it: the stored array, or for bfloat16
        storage its exact float32 upcast (a new array: only the tensors in use are float32 at
        a time). Every read of ``params`` in a forward pass goes through here."""
        a = self.params[name]
        return to_float32(a) if self.storage == "bfloat16" else a

    def fweight(self, name: str):
        """:meth:`fparam` of a weight matrix that one GEMM reads at once: on the CPU under
        bfloat16 storage the exact upcast goes into a buffer kept per thread (one pass and
        no allocation: a new float32 array per projection faulted in 14 MB a block, each
        thread its own), valid until this thread's next :meth:`fweight` call; otherwise
        :meth:`fparam`."""
        a = self.params[name]
        if self.storage != "bfloat16" or self.xp is not np:
            return self.fparam(name)
        return to_float32(a, out=scratch(np, "fweight", a.shape, np.float32))

    # ------------------------------------------------------------------ projections
    #: pack the real rows when at least this share of a row block is padding
    pack_min_share = 1.0 / 16

    def _pack_rows(self, qmask):
        """Rows (flat indices into the (B*T) rows of ``qmask`` (B, T)) that a block computes,
        or None for all of them: the real tokens, when padding is at least
        :attr:`pack_min_share` of the rows (a lone real token takes a padded row along: a
        one-row product is a GEMV; no real token: empty). Padded rows are never read by a
        real token (attention gives them exact zeros, the losses and pooling skip them), so
        skipping them changes a real row by float32 rounding at most, and not at all where a
        GEMM row does not depend on the rows around it (OpenBLAS's AVX-512 kernels on
        products of an LLM's sizes; docs/guide.md, "BLAS kernels"). On the GPU this reads
        the mask's count once per batch. Used by the decoder forwards (:class:`CausalLM`;
        GPT-2's :class:`Decoder` on the CPU) and the encoder's blocks on the CPU
        (:class:`Encoder`)."""
        xp = self.xp
        real = (qmask > 0).reshape(-1)
        n = real.shape[0]
        k = int(real.sum())
        if n - k < max(1, n * self.pack_min_share) or n < 2:
            return None
        rows = xp.flatnonzero(real)
        if k == 1:                                  # keep a GEMM: add the first padded row
            pad = int(xp.flatnonzero(~real)[0])
            rows = xp.sort(xp.concatenate([rows, xp.asarray([pad], dtype=rows.dtype)]))
        return rows

    def _layer_buffers(self, bsz: int, t: int):
        """Per-layer scratch arrays, reused by every layer (only one layer's activations live):
        qkv (n, 3h), scores (B*heads, t, t) and its 4-D view, ctx (B, t, heads, d), tmp (n, h),
        inter (n, intermediate), and the attention scale 1/sqrt(d)."""
        cfg, xp, dt = self.config, self.xp, self.dtype
        n, h, nh, d = bsz * t, cfg.hidden_size, cfg.num_heads, cfg.head_dim
        scores = xp.empty((bsz * nh, t, t), dtype=dt)
        return (xp.empty((n, 3 * h), dtype=dt), scores, xp.empty((bsz, t, nh, d), dtype=dt),
                xp.empty((n, h), dtype=dt), xp.empty((n, cfg.intermediate_size), dtype=dt),
                1.0 / math.sqrt(d), scores.reshape(bsz, nh, t, t))

    def set_matmul(self, mode: str) -> None:
        """The arithmetic of the projections and the LM head (deck ``model.matmul``):
        "float32" (the default: every product in float32, the same bits on CPU and GPU) or
        "bfloat16" (inputs rounded to bfloat16, float32 accumulation: the GPU's tensor cores,
        :mod:`semzo.model.gemm`); "bfloat16" needs a decoder with bfloat16 storage.
        ValueError otherwise."""
        if mode not in MATMUL_MODES:
            raise ValueError(f"model.matmul = {mode!r}: choose one of {', '.join(MATMUL_MODES)}")
        if mode == "bfloat16" and (self.kind != "decoder" or self.storage != "bfloat16"):
            raise ValueError(f"model.matmul = 'bfloat16' needs a decoder stored as bfloat16 "
                             f"(model.dtype = 'bfloat16'); this model: {self.kind}, stored "
                             f"as {self.storage}")
        self.matmul = mode

    def _gemv_rows(self, rows: int, out_in: bool = False) -> bool:
        """Whether a GEMM of ``rows`` rows of a decoder reads its weight in place with float32
        products (:func:`semzo.model.gemm_cpu.gemv_f32`): on the CPU, ``matmul ==
        "float32"``, weights (out, in) (``out_in``: this one is, as an LM head always is),
        at most GEMV_ROWS rows (a generated token): upcasting a bfloat16 weight whole to
        multiply one row by it costs more than the product, and OpenBLAS's one-row products
        read float32 weights slower. Decoders only: an encoder's embeddings keep OpenBLAS's
        sums at every batch size."""
        return (self.kind == "decoder" and self.xp is np and self.matmul == "float32"
                and self.storage in ("float32", "bfloat16")
                and (out_in or self.layout == "out_in") and rows <= GEMV_ROWS)

    def gemm_input(self, x):
        """What :meth:`_proj` takes as ``xb`` for several projections of one input x: its
        bfloat16 bits with ``matmul == "bfloat16"`` (converted once), else None."""
        return bf16_input(x) if self.matmul == "bfloat16" else None

    def _proj(self, x, module: str, out, xb=None):
        """``out = x @ W.T`` (or ``x @ W`` for Conv1D) plus the LoRA delta; bias not added.

        x: (N, in) of the model dtype; out: (N, out), written in full. With
        ``matmul == "bfloat16"`` the product is :func:`semzo.model.gemm.matmul_bf16` of the
        stored bits (``xb``: :meth:`gemm_input` of x, or None; the LoRA delta stays float32);
        a decoder's few rows on the CPU read the weight in place (:meth:`_gemv_rows`).
        """
        if self.matmul == "bfloat16":
            matmul_bf16(x, self.params[module + ".weight"], out, self.layout == "out_in", xb)
        elif self._gemv_rows(x.shape[0]) and gemv_f32_usable(x, self.params[module + ".weight"],
                                                             out):
            gemv_f32(x, self.params[module + ".weight"], out)   # a few rows: weight in place
        else:
            w = self.fweight(module + ".weight")
            # the GPU: one cuBLAS sgemm straight into out (a column slice: no copy)
            if self.xp is np or not matmul_f32(x, w, out, self.layout == "out_in"):
                matmul_into(x, w.T if self.layout == "out_in" else w, out)
        spec = self.lora.get(module)
        if spec is not None:
            self._lora_add(x, spec, out)
        return out

    def _proj_many(self, x, modules, outs, xb=None) -> None:
        """:meth:`_proj` of one x by each of ``modules`` into the matching ``outs`` (a
        block's q, k, v, or gate and up): for a few rows (:meth:`_gemv_rows`) one launch of
        :func:`semzo.model.gemm_cpu.gemv_f32_many` for all of them (the bits of one
        :meth:`_proj` each; a generated token then pays one launch and its Python for
        the three); with ``matmul == "bfloat16"`` :func:`semzo.model.gemm.matmul_bf16_many`
        (on the CPU the activations packed once for all); else one :meth:`_proj` each."""
        if self.matmul == "bfloat16" and self.layout == "out_in":
            matmul_bf16_many(x, [self.params[mod + ".weight"] for mod in modules], outs, xb)
            self._lora_adds(x, modules, outs)
            return
        if self.matmul == "float32" and self._gemv_rows(x.shape[0]):
            ws = [self.params[mod + ".weight"] for mod in modules]
            if all(gemv_f32_usable(x, w, o) for w, o in zip(ws, outs)):
                gemv_f32_many(x, ws, outs)
                self._lora_adds(x, modules, outs)
                return
        for mod, o in zip(modules, outs):
            self._proj(x, mod, o, xb)

    def _lora_adds(self, x, modules, outs) -> None:
        """Each LoRA delta of ``modules`` added into the matching ``outs`` (:meth:`_proj`'s
        last step)."""
        for mod, o in zip(modules, outs):
            spec = self.lora.get(mod)
            if spec is not None:
                self._lora_add(x, spec, o)

    def _lora_add(self, x, spec: LoraSpec, out) -> None:
        """``out += (x @ A.T) @ B.T * scale`` (out may be a column slice). On the GPU in
        float32: two cuBLAS sgemm calls, the scale as the first's alpha and the sum into
        ``out`` as the second's beta (five kernels and two allocations before)."""
        a, b = self.fparam(spec.a), self.fparam(spec.b)
        if self.xp is not np:
            t = self.xp.empty((x.shape[0], a.shape[0]), dtype=x.dtype)
            if matmul_f32(x, a, t, True, alpha=spec.scale):
                if not matmul_f32(t, b, out, True, beta=1.0):
                    out += t @ b.T
                return
        t = x @ a.T
        t *= self.dtype.type(spec.scale)
        out += t @ b.T

    # ------------------------------------------------------------------ inputs and pooling
    def _inputs(self, input_ids, attention_mask):
        """ids as a C-contiguous integer array of xp and the key mask as float32 (B, T)."""
        xp = self.xp
        ids = xp.ascontiguousarray(xp.asarray(input_ids))
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be a 2-D integer array, got {ids.shape} {ids.dtype}")
        if isinstance(input_ids, np.ndarray):       # checked on the host: no device sync
            check_ids(np, input_ids, self.config.vocab_size)
        else:
            check_ids(xp, ids, self.config.vocab_size)
        if ids.shape[1] > self.config.max_positions:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's "
                             f"{self.config.max_positions} positions")
        if attention_mask is None:
            maskf = xp.ones(ids.shape, dtype=xp.float32)
        else:
            maskf = xp.ascontiguousarray(xp.asarray(attention_mask).astype(xp.float32))
            if maskf.shape != ids.shape:
                raise ValueError(f"attention_mask {maskf.shape} does not match ids {ids.shape}")
        return ids, maskf

    #: batches with fewer tokens run on one thread even when set_threads(n > 1)
    split_min_tokens = 256

    def hidden_states(self, input_ids, attention_mask=None, **kwargs):
        """Final hidden states (B, T, H) in the model dtype; padded positions hold finite values
        that mean nothing. On CPU with ``set_threads(n > 1)`` the batch is split into row blocks
        run concurrently (same results: rows are independent)."""
        ids, maskf = self._inputs(input_ids, attention_mask)
        if self.xp is not np:
            return self._hidden(ids, maskf, **kwargs)
        extra = {k: np.asarray(v) for k, v in kwargs.items() if v is not None}

        def run(sl):
            return self._hidden(ids[sl], maskf[sl], **{k: v[sl] for k, v in extra.items()})
        parts = run_split(run, ids.shape[0], self.split_min_tokens, ids.shape[1])
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def _hidden(self, ids, maskf, **kwargs):
        """Forward pass on prepared inputs: ids (B, T) integers, maskf (B, T) float32."""
        raise NotImplementedError

    def pooled(self, input_ids, attention_mask=None, normalize: bool = True):
        """Mean of the final hidden states over unmasked tokens, float32 (B, H); L2-normalized
        when ``normalize`` (the sentence-transformers pipeline of all-MiniLM-L6-v2)."""
        xp = self.xp
        hs = self.hidden_states(input_ids, attention_mask)
        _, maskf = self._inputs(input_ids, attention_mask)
        return mean_pool(xp, hs, maskf, normalize)

    def embed(self, input_ids, attention_mask=None):
        """Sentence embeddings (B, H) float32: mean pooling + L2 normalization."""
        return self.pooled(input_ids, attention_mask, normalize=True)

    def classify(self, input_ids, attention_mask, labels):
        """Classification head: returns ``(loss, accuracy, logits)``.

        ``loss`` (float) is the mean cross-entropy over the batch, computed in float64 from
        float32 logits; ``accuracy`` (float) the share of argmax hits; ``logits`` (B, C) float32
        in xp. Needs :meth:`add_classifier` first.
        """
        if self.head is None:
            raise RuntimeError("no classification head: call add_classifier(n_classes) first")
        hs = self.hidden_states(input_ids, attention_mask)
        _, maskf = self._inputs(input_ids, attention_mask)
        return self.classify_hidden(hs, maskf, labels)

    def classify_hidden(self, hs, maskf, labels):
        """:meth:`classify` from final hidden states ``hs`` (B, T, H) and the float mask
        ``maskf`` (B, T): pooling, head, cross-entropy. Returns ``(loss, accuracy, logits)``."""
        if self.head is None:
            raise RuntimeError("no classification head: call add_classifier(n_classes) first")
        xp = self.xp
        pooled = mean_pool(xp, hs, xp.asarray(maskf, dtype=xp.float32), self.head.normalize)
        w = to_float32(self.params["classifier.weight"])
        b = to_float32(self.params["classifier.bias"])
        logits = pooled @ w.T + b
        lab = xp.asarray(labels).astype(xp.int64).reshape(-1)
        check_labels(labels if isinstance(labels, np.ndarray) else lab, self.head.n_classes)
        loss, acc = cross_entropy(xp, logits, lab)
        return loss, acc, logits


    # ------------------------------------------------------------------ next-token loss
    def _head(self, hs2, w=None):
        """float32 next-token logits (N, V) of final hidden states (N, H) (decoders); ``w``:
        :meth:`_head_w` read once by the caller (None: read here)."""
        raise NotImplementedError(f"{type(self).__name__} has no language-model head")

    def _head_w(self):
        """The LM head matrix (V, H) as the forward reads it (float32 for bfloat16)."""
        raise NotImplementedError(f"{type(self).__name__} has no language-model head")

    def next_token_loss(self, input_ids, attention_mask=None, chunk: int = 256,
                        return_accuracy: bool = False):
        """Mean cross-entropy of predicting token t+1 from positions <= t (float).

        Targets at padded positions (mask 0) do not count, as with Hugging Face labels set to
        -100 there. The (rows, V) logits are computed ``chunk`` rows at a time.
        With ``return_accuracy``, returns ``(loss, accuracy)``.
        """
        ids, maskf = self._inputs(input_ids, attention_mask)
        return self.next_token_loss_from_hidden(self.hidden_states(ids, maskf), ids, maskf,
                                                chunk, return_accuracy)

    def next_token_loss_from_hidden(self, hidden, ids, maskf, chunk: int = 256,
                                    return_accuracy: bool = False):
        """:meth:`next_token_loss` from final hidden states ``hidden`` (B, T, H) of the
        checked ids (B, T) and float mask (B, T) (a streamed schedule's last stage)."""
        xp = self.xp
        b, t = ids.shape
        hs = hidden[:, :-1].reshape(b * (t - 1), -1)
        tgt = ids[:, 1:].reshape(-1).astype(xp.int64)
        wt = maskf[:, 1:].reshape(-1)
        if xp is np and hs.dtype == np.float32:
            return self._nll_cpu(hs, tgt, wt, chunk, return_accuracy)
        # other dtypes and the GPU: the sums stay on the device, one transfer at the end (a
        # float() per chunk would synchronize the stream 3 times per chunk)
        wh = np.asarray(wt.get() if hasattr(wt, "get") else wt, np.float64)
        tot = xp.zeros(2, xp.float64)
        w = self._head_w()                         # read (bfloat16: upcast) once
        for r in _row_chunks(wh, chunk):
            ri = xp.asarray(r)
            tot += cross_entropy_sums(xp, self._head(hs[ri], w), tgt[ri], wt[ri])
        n = max(float(wh.sum()), 1.0)
        tot_l, tot_a = (float(v) / n for v in (tot.get() if hasattr(tot, "get") else tot))
        return (tot_l, tot_a) if return_accuracy else tot_l

    def _nll_cpu(self, hs, tgt, wt, chunk: int, return_accuracy: bool):
        """The CPU next-token loss: the rows with a target (:func:`_row_chunks`: padded rows
        skipped) in chunks of ``chunk`` rows shared among the forward threads
        (:func:`semzo.model.kernels.set_threads`), each chunk's float32 logits reduced by
        the Numba kernel ``token_nll`` (float64 log-sum-exp) while they are in cache; the head
        weight is read (for bfloat16: upcast) once. The chunks depend on the weights only and
        the sums run over every row in order: the same bits for any thread count."""

        n_rows = hs.shape[0]
        chunks = _row_chunks(wt, chunk)
        nll = np.zeros(n_rows, np.float64)
        hit = np.zeros(n_rows, np.float64)
        w = self._head_w()

        def head(rows):
            # a chunk's logits (256 x 49,152 floats for SmolLM2: 50 MB) in this thread's
            # scratch buffer, not faulted in afresh for every chunk of every forward pass
            h = hs[rows]
            return self._head(h, w, out=scratch(np, "head_chunk", (h.shape[0], w.shape[0]),
                                                np.float32))

        def run(sl):
            for r in chunks[sl]:
                if r[-1] - r[0] + 1 == len(r):      # consecutive rows: write in place
                    rs = slice(int(r[0]), int(r[-1]) + 1)
                    token_nll(head(rs), tgt[rs], nll[rs], hit[rs])
                    continue
                nl, ht = np.empty(len(r)), np.empty(len(r))
                token_nll(head(r), tgt[r], nl, ht)
                nll[r], hit[r] = nl, ht

        run_slices(run, split_slices(len(chunks), 0, 1))
        wd = wt.astype(np.float64)
        n = max(float(wd.sum()), 1.0)
        loss = float((nll * wd).sum()) / n
        return (loss, float((hit * wd).sum()) / n) if return_accuracy else loss


def _row_chunks(weights, chunk: int) -> list:
    """Index arrays of the rows of ``weights`` (N,) (host) that are not 0, in order, cut into
    chunks of about equal size, at most ``chunk`` rows each, their count rounded up to a
    multiple of 4 (1, 2 and 4 threads share them evenly). They depend on the weights only,
    so each GEMM, hence each bit, is the same for any thread count. No chunk has one row
    unless N is 1 (a one-row product is a GEMV: a lone row takes a zero-weight neighbour
    along)."""
    w = np.asarray(weights)
    n = w.shape[0]
    rows = np.flatnonzero(w)
    if len(rows) == 1 and n > 1:
        rows = np.array([0, 1] if rows[0] == 0 else [rows[0] - 1, rows[0]], dtype=rows.dtype)
    if not len(rows):
        return []
    k = -(-len(rows) // chunk)
    k = max(1, min(-(-k // 4) * 4, len(rows) // 2))
    bounds = np.linspace(0, len(rows), k + 1).round().astype(int)
    return [rows[a:b] for a, b in itertools.pairwise(bounds)]

"""The spec-driven causal decoder: one block, described by a :class:`DecoderSpec`, runs every
decoder: the Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, Phi-3, SmolLM3, OPT and GPT-2 families (see
:mod:`semzo.model.families`; the later families' pieces live in :mod:`semzo.model.variants`),
NumPy or CuPy.

Shapes: ids (B, T) integers, mask (B, T) 0/1, right padding. Activations are 2-D (B*T, H) so
every projection is one GEMM (``TransformerBase._proj``: weights (out, in), LoRA deltas).
Attention is grouped by key/value head: the g = heads / kv_heads query heads that share a
K/V head form one (g*T, d) x (d, Tk) GEMM. Positions follow transformers for a right-padded
batch: 0..T-1 (rotary families, GPT-2), ``cumsum(mask) * mask - 1 + 2`` (OPT). GPT-2 keeps its
Conv1D weights (in, out) (``spec.layout``; ``_proj`` reads either layout).

Stages (the block-streamed schedule runs them one at a time): stage 0 = embeddings (+ learned
positions, ``project_in``), stage 1..L = block i-1, stage L+1 = final norm (+ ``project_out``;
the LM head and ``classifier.*`` belong to it). ``hidden_states`` is the composition of the
stages, so both agree bit for bit. KV cache: :meth:`new_cache` / :meth:`forward_cached`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from semzo.model import decode
from semzo.model import variants as vx
from semzo.model.base import TransformerBase
from semzo.model.gemm import batched_matmul_f32, matmul_bf16
from semzo.model.gemm_cpu import gemv_f32, gemv_f32_usable
from semzo.model.kernels import (
    OutputCache,
    bias_act,
    bias_residual_layernorm,
    layernorm,
    matmul_into,
    run_slices,
    run_split,
    scratch,
    split_slices,
)
from semzo.model.kernels_lm import (
    attend_one,
    attend_one_usable,
    attn_softmax,
    gated_act,
    heads_to_rows,
    residual_add,
    residual_add_t,
    residual_rmsnorm,
    rmsnorm,
    rope_split,
    with_bf16_bits,
)
from semzo.model.spec import expected_tensors
from semzo.model.storage import BF16, to_float32

__all__ = ["CausalLM", "DecoderState", "KVCache", "expected_tensors"]

_PROJ = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")   # module order


@dataclass
class DecoderState:
    """What flows between stages: ids (B, T), maskf (B, T) float32, pos (B, T) int64 (rotary:
    angle rows; learned: rows of the position table), ``hidden`` (B, T, H) in the model dtype
    (None before stage 0), ``stage``: the next stage to run."""

    ids: object
    maskf: object
    pos: object
    hidden: object = None
    stage: int = 0
    packs: dict = field(default_factory=dict, repr=False)   # "plan": CausalLM._plan's

    def fork(self) -> DecoderState:
        """An independent copy (its own residual stream) for another branch (the packed row
        indices, which depend on the mask only, are shared)."""
        return replace(self, hidden=None if self.hidden is None else self.hidden.copy())

    def nbytes_live(self) -> int:
        """Bytes of the state's own array (the residual stream)."""
        return 0 if self.hidden is None else int(self.hidden.nbytes)

    @property
    def slices(self) -> list[slice]:
        """The row blocks the threads take now (each a run of consecutive groups of the plan,
        as ``StageState.slices``)."""
        groups, w = self.packs["plan"]
        return [slice(groups[sh.start][0].start, groups[sh.stop - 1][0].stop)
                for sh in _shares(groups, w)]


def _shares(groups, w) -> list[slice]:
    """Consecutive groups per thread (by their real tokens)."""
    return [slice(0, 1)] if len(groups) == 1 else split_slices(len(groups), 0, 1, w)


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far: ``k[i]``, ``v[i]`` (B, kv_heads, max_len, d)
    per layer, ``maskf`` (B, max_len) float32, ``length`` (tokens so far, the same for every
    row), ``seen`` (B,) int64 real tokens per row (OPT positions)."""

    k: list
    v: list
    maskf: object
    seen: object
    length: int = 0


class CausalLM(TransformerBase):
    """A decoder driven by :attr:`config` (a :class:`DecoderSpec`). See
    :class:`~semzo.model.base.TransformerBase` for the parameter contract: ``params`` holds the
    checkpoint tensors under their Hugging Face names in stage order (embeddings, blocks, final
    norm, untied ``lm_head.weight``); a tied LM head reads the embedding matrix (stage 0)."""

    kind = "decoder"
    layout = "out_in"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s, pre, xp = self.config, self.prefix, self.xp
        self._mods = [{role: pre + s.names.layer_prefix.format(i=i) + mod
                       for role, mod in s.names.layer} for i in range(s.num_layers)]
        self._stage_of = {n: st for n, _, st in expected_tensors(s, pre)}
        self._ones = xp.ones(s.hidden_size, dtype=self.dtype)
        self._zeros = xp.zeros(s.hidden_size, dtype=self.dtype)
        self._rope: dict = {}                                  # RopeSpec -> tables
        self.scale = s.attn_scale or 1.0 / math.sqrt(s.head_dim)
        self.layout = s.layout
        self._logits_out = OutputCache()                       # logits' (B, T, V) on NumPy

    # ------------------------------------------------------------------ contract
    @property
    def n_stages(self) -> int:
        return self.config.num_layers + 2

    @property
    def tied_head(self) -> bool:
        return self.config.tied

    def stage_names(self, k: int) -> list[str]:
        """Names of ``params`` that stage ``k`` reads, in collection order."""
        if not 0 <= k < self.n_stages:
            raise ValueError(f"stage must lie in [0, {self.n_stages}), got {k}")
        return [n for n in self.params if self.stage_of(n) == k]

    def _base_stage(self, name: str) -> int | None:
        return self._stage_of.get(name)

    def stage_of(self, name: str) -> int:
        """The stage that reads ``name`` (LoRA A/B: their projection's block; classifier and
        anything else: the last stage)."""
        st = self._stage_of.get(name)
        if st is None and name.endswith((".lora_A.weight", ".lora_B.weight")):
            st = self._stage_of.get(name.rsplit(".", 2)[0] + ".weight")
        return self.n_stages - 1 if st is None else st

    def lora_modules(self) -> list[str]:
        """Every projection: q, k, v (or qkv), o, the MLP's (``add_lora(targets=...)``); those
        of ``spec.lora_roles`` when the family names them (GPT-2: attention only)."""
        roles = self.config.lora_roles or _PROJ
        return [m[r] for m in self._mods for r in _PROJ if r in m and r in roles]

    def add_classifier(self, n_classes: int, init: str = "normal", std: float = 0.02,
                       seed: int = 0, normalize: bool = False) -> None:
        """As the base class; the head reads the final hidden states (width ``embed_dim``:
        OPT's ``word_embed_proj_dim`` when it has ``project_out``)."""
        super().add_classifier(n_classes, init, std, seed, normalize)
        e = self.config.embed_dim
        if e != self.config.hidden_size:
            w = np.random.default_rng(seed).normal(0.0, std, size=(n_classes, e)) \
                if init == "normal" else np.zeros((n_classes, e))
            self.params["classifier.weight"] = self.to_param(w)

    # ------------------------------------------------------------------ stages
    def gather_rows(self, input_ids) -> dict:
        """The token embedding matrix (see the base class; the LM head reads it too when
        tied)."""
        return {self.prefix + self.config.names.embed: np.unique(np.asarray(input_ids))}

    def stage_start(self, input_ids, attention_mask=None) -> DecoderState:
        """Checked inputs and positions (reads no parameter). SemzoError-free ValueError for
        malformed arrays; token ids outside [0, vocab) raise naming the id."""
        ids, maskf = self._inputs(input_ids, attention_mask)
        return DecoderState(ids, maskf, self._positions(maskf, 0, None),
                            packs={"plan": self._plan(maskf)})

    def _positions(self, maskf, past: int, seen):
        """Positions (B, T) int64: full forward: ``0..T-1`` (rotary; transformers without
        position ids) or ``cumsum(mask) * mask - 1 + offset`` (OPT). Cached (``seen``: real
        tokens per row so far): a new real token's position is the row's count of real tokens
        before it, as transformers' ``generate`` computes position ids from the mask, so a
        right-padded prompt continues without a gap; padded new tokens get position 0 (rotary)
        or ``offset - 1`` (OPT), never read by a real token."""
        xp, s = self.xp, self.config
        b, t = maskf.shape
        if s.pos_from_mask or seen is not None:
            m = (maskf > 0).astype(xp.int64)
            base = 0 if seen is None else seen[:, None]
            pos = (base + xp.cumsum(m, axis=1)) * m - 1
            return pos + s.pos_offset if s.pos_from_mask else xp.maximum(pos, 0)
        return xp.ascontiguousarray(xp.broadcast_to(xp.arange(past, past + t, dtype=xp.int64),
                                                    (b, t)))

    def stage_forward(self, k: int, state: DecoderState) -> DecoderState:
        """Run stage ``k`` on ``state`` in place and return it (``state.fork()`` first to keep
        the input); reads only stage k's parameters. After the last stage ``hidden`` holds
        the final hidden states (B, T, E) (E = ``embed_dim``). The residual stream of a block
        is updated in place; the embedding and final stages make new arrays."""
        if k != state.stage:
            raise ValueError(f"stage {k} run on a state whose next stage is {state.stage}")
        ids, maskf, pos = state.ids, state.maskf, state.pos
        t = ids.shape[1]
        plan = state.packs.get("plan")
        if plan is None:
            plan = state.packs["plan"] = self._plan(maskf)
        if k == 0:
            state.hidden = self._map_groups(lambda sl, _: self._embed(ids[sl], pos[sl]), plan)
        elif k <= self.config.num_layers:
            x = state.hidden

            def run(sl, rows):
                xs = x[sl].reshape(-1, x.shape[-1])
                self._block(k - 1, xs, maskf[sl], pos[sl], None, None, 0, rows)
            self._map_groups(run, plan, collect=False)
        elif k == self.n_stages - 1:
            h = state.hidden
            state.hidden = self._map_groups(lambda sl, rows: self._final(
                h[sl].reshape(-1, h.shape[-1]), rows).reshape(h[sl].shape[0], t, -1), plan)
        else:
            raise ValueError(f"stage must lie in [0, {self.n_stages}), got {k}")
        state.stage = k + 1
        return state

    #: a batch of at least ``split_min_tokens`` real tokens is cut into groups of about this
    #: many real tokens (an even number of them)
    group_tokens = 512

    def _plan(self, maskf) -> tuple[list, list | None]:
        """How the CPU forward cuts a batch: ``(groups, weights)``, ``groups`` a list of
        ``(row slice, packed rows)`` (:meth:`_pack_rows` of that slice) and ``weights`` their
        real tokens. The groups are consecutive rows of about ``group_tokens`` real tokens, an
        even number of them (2 threads share them evenly) unless the batch has fewer rows, one
        group below ``split_min_tokens``; they depend on the mask only, so every GEMM, hence
        every bit, is the same for any thread count (the threads take consecutive groups).
        Why about 512: the GEMMs of a block run faster on more rows (SmolLM2's, one thread,
        2026-11-27: 82, 89, 95 and 98 GFLOP/s on 128, 256, 512 and 1024 rows); groups of 256
        in a multiple of 4 (until then) cost the 8 x 128 forward 3-5 % at 2 threads and a
        training batch of 8 x 48 at one rank's thread a fifth of its speed (4 groups of 96
        rows). The GPU runs one group."""
        b = maskf.shape[0]
        if self.xp is not np:
            return [(slice(0, b), self._pack_rows(maskf))], None
        real = (maskf > 0).sum(axis=1)
        tot = int(real.sum())
        n = 1 if tot < self.split_min_tokens else -(-tot // self.group_tokens)
        n = min(b, n + n % 2 if n > 1 else n)
        slices = split_slices(b, 0, 1, real, parts=n)
        return ([(sl, self._pack_rows(maskf[sl])) for sl in slices],
                [int(real[sl].sum()) for sl in slices])

    @staticmethod
    def _map_groups(fn, plan, collect: bool = True):
        """``fn(row_slice, rows)`` over the plan's groups, consecutive groups per thread; the
        results concatenated in row order (``collect``)."""
        groups, w = plan
        if len(groups) == 1:
            out = [fn(*groups[0])]
        else:
            out = [o for part in run_slices(lambda sh: [fn(*g) for g in groups[sh]],
                                            _shares(groups, w))
                   for o in part]
        if not collect:
            return None
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def _split(self, fn, b: int, t: int, collect: bool = True):
        if self.xp is not np:
            return fn(slice(0, b))
        parts = run_split(fn, b, self.split_min_tokens, t)
        if not collect:
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def hidden_states(self, input_ids, attention_mask=None):
        """Final hidden states (B, T, E) in the model dtype: the composition of the stages.
        Each group (on the CPU each thread its groups) goes through every stage at once
        (:meth:`_groups_through`): the same operations on the same rows, hence the same
        bits, as stage after stage, without a meeting of the threads at every block and
        with the real rows packed once for all the blocks."""
        return self._groups_through(self.stage_start(input_ids, attention_mask))

    def _groups_through(self, st: DecoderState):
        """:meth:`hidden_states` of a prepared state, group by group: each thread runs its
        consecutive groups through the embeddings, every block and the final norm (the
        stages' code on the group's rows, as :meth:`stage_forward` runs it). A forward of
        SmolLM2 at 8 x 128 on 2 threads met at 32 stages before (2026-11-27). One group (the
        GPU's, or a small batch): no thread."""
        groups, w = st.packs["plan"]
        ids, maskf, pos = st.ids, st.maskf, st.pos
        t, layers = ids.shape[1], range(self.config.num_layers)

        def share(sh: slice) -> list:
            out = []
            for sl, rows in groups[sh]:
                x = self._embed(ids[sl], pos[sl])
                xs = x.reshape(-1, x.shape[-1])
                self._blocks(layers, xs, maskf[sl], pos[sl], rows)
                out.append(self._final(xs, rows).reshape(x.shape[0], t, -1))
            return out

        if len(groups) == 1:
            return share(slice(0, 1))[0]
        parts = [o for part in run_slices(share, _shares(groups, w)) for o in part]
        return np.concatenate(parts, axis=0)

    # ------------------------------------------------------------------ pieces
    def _embed(self, ids, pos):
        """(B, T, H) residual stream entering block 0."""
        xp, s, p, pre = self.xp, self.config, self.params, self.prefix
        b, t = ids.shape
        x = self._rows(p[pre + s.names.embed], ids.reshape(-1))
        if s.embed_scale:
            vx.scale_embeddings(self, x)
        if s.proj_dim:
            y = xp.empty((b * t, s.hidden_size), dtype=self.dtype)
            x = self._proj(x, f"{pre}{s.names.project_in}", y)
        if s.positions == "learned":
            x += self._rows(p[pre + s.names.pos], pos.reshape(-1))
        return x.reshape(b, t, s.hidden_size)

    def _rows(self, table, idx):
        """Rows ``idx`` of an embedding table, in the compute dtype (bfloat16: only the rows
        read are upcast, not the table)."""
        x = self.xp.take(table, idx, axis=0)
        return to_float32(x) if self.storage == "bfloat16" else x

    def _final(self, x, rows=None):
        """Final norm (+ project_out) of the residual stream x (N, H) -> (N, E), new array.
        ``rows``: the rows the blocks computed (packed); the others come out zero."""
        s, pre = self.config, self.prefix
        a = self._norm(x, pre + s.names.final_norm, self.xp.empty_like(x)) if s.final_norm \
            else x.copy()
        if s.proj_dim:
            y = self.xp.empty((a.shape[0], s.embed_dim), dtype=self.dtype)
            a = self._proj(a, f"{pre}{s.names.project_out}", y)
        if rows is not None:
            keep = self.xp.zeros(a.shape[0], dtype=bool)
            keep[rows] = True
            a[~keep] = 0.0
        return a

    def _nw(self, mod: str):
        s = self.config
        if s.norm_affine and s.norm == "rmsnorm" and not s.norm_plus_one and \
                self.storage == "bfloat16":         # bits: both RMSNorm kernels widen them
            g = self.params[mod + ".weight"]        # (no float32 copy a call)
        else:
            g = self.fparam(mod + ".weight") if s.norm_affine else self._ones
        if s.norm_plus_one:
            g = vx.plus_one(g)
        return g, (self.fparam(mod + ".bias") if s.norm_bias else self._zeros)

    def _norm(self, x, mod: str, out, bits=None):
        """``out = norm(x)``; ``bits``: a uint16 array of out's shape that also receives the
        bfloat16 bits of out (the projections' input of model.matmul = "bfloat16")."""
        g, bta = self._nw(mod)
        if self.config.norm == "rmsnorm":
            return rmsnorm(x, g, self.config.norm_eps, out, bits)
        return with_bf16_bits(layernorm(x, g, bta, self.config.norm_eps, out=out), bits)

    def _residual_norm(self, x, bias, resid, mod: str, out, bits=None):
        """``resid += x (+ bias)``; ``out = norm(resid)`` (out may be resid); ``bits``: as
        :meth:`_norm`."""
        g, bta = self._nw(mod)
        if self.config.norm == "rmsnorm":
            return residual_rmsnorm(x, bias, resid, g, self.config.norm_eps, out, bits)
        return with_bf16_bits(bias_residual_layernorm(x, self._zeros if bias is None else bias,
                                                  resid, g, bta, self.config.norm_eps, out),
                          bits)

    def _norm_bits(self, shape):
        """A uint16 array for :meth:`_norm`'s ``bits`` with model.matmul = "bfloat16", else
        None."""
        return self.xp.empty(shape, self.xp.uint16) if self.matmul == "bfloat16" else None

    def _bias(self, mod: str, flag: bool):
        return self.fparam(mod + ".bias") if flag else None

    def _blocks(self, layers, x, maskf, pos, rows, cache=None, past: int = 0) -> None:
        """Blocks ``layers`` (indices, in order) on the residual stream x (B*T, H) in place,
        as :meth:`_block` one after the other (``cache``: a :class:`KVCache` to append to at
        ``past``), with the real rows (``rows``) taken out once before the first block and
        put back once after the last: a block reads and writes only the rows it computes,
        so the bits are those of :meth:`_block` per block, without a gather and a scatter of
        the residual stream at every block (on a GPU two CuPy fancy-indexing calls per block:
        in the eleventh GPU call's host profile 9 ms of host time per three SmolLM2 forwards,
        about 50 us a call; 2026-11-28)."""
        if rows is not None and not len(rows):      # padding only: nothing to compute
            return
        xr = x if rows is None else x[rows]
        for i in layers:
            kc, vc = (None, None) if cache is None else (cache.k[i], cache.v[i])
            self._block_rows(i, xr, rows, maskf, pos, kc, vc, past)
        if rows is not None:
            x[rows] = xr

    def _block(self, i: int, x, maskf, pos, kc, vc, past: int, rows=None) -> None:
        """Block ``i`` on the residual stream x (B*T, H), in place. ``kc``/``vc``: cache
        arrays (B, kv, max_len, d) to append to at ``past`` (None: this batch only).
        ``rows``: the rows to compute (:meth:`_pack_rows`; None: all; empty: none, the block
        is skipped): the projections, norms and MLP run on those rows only, attention on the
        padded layout (padded rows of queries, keys and values zero); the other rows of x are
        left as they are."""
        if rows is None:
            return self._block_rows(i, x, None, maskf, pos, kc, vc, past)
        if not len(rows):                           # padding only: nothing to compute
            return None
        xr = x[rows]
        self._block_rows(i, xr, rows, maskf, pos, kc, vc, past)
        x[rows] = xr

    def _block_rows(self, i: int, x, rows, maskf, pos, kc, vc, past: int) -> None:
        xp, s, dt, m = self.xp, self.config, self.dtype, self._mods[i]
        b, t = pos.shape
        h, nh, nkv, d = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
        nq, nk = nh * d, nkv * d
        nr = x.shape[0]                             # rows computed (b t, or fewer packed)
        ab = self._norm_bits(x.shape) if s.pre_norm else None
        a = self._norm(x, m["norm1"], scratch(xp, "a", x.shape, x.dtype), ab) if s.pre_norm \
            else x
        qkv = scratch(xp, "qkv", (nr, nq + 2 * nk), dt)
        biases = vx.project_qkv(self, a, m, qkv, nh, nkv, d, ab)
        if kc is None:
            kc = scratch(xp, "k", (b, nkv, t, d), dt)
            vc = scratch(xp, "v", (b, nkv, t, d), dt)
        q = scratch(xp, "q", (b, nh, t, d), dt)
        cos = sin = None
        rope = s.layer_rope(i)
        if rope is not None:
            cos, sin = vx.rope_tables(self, past + t, rope)
        # into the padded layout attention reads (qkv holds the packed rows when rows)
        rope_split(qkv, biases, pos, cos, sin, nh, nkv, d, q, kc, vc, past, rows)
        scale = self.scale / (i + 1) if s.scale_by_layer else self.scale   # GPT-2's option
        cb = None                                   # the bits of ctx, when a kernel writes them
        one = scratch(xp, "ctx", (b, nq), dt) if t == 1 and not s.attn_softcap and \
            xp is np else None
        if one is not None and attend_one_usable(q, kc, vc, maskf, one):
            # a generated token on the CPU: scores, softmax and context in one call
            attend_one(q, kc, vc, maskf, scale, past, s.window(i), one)
            ctx = one if rows is None else one[rows]
        else:
            ctx, cb = self._attend(i, q, kc, vc, maskf, scale, past, rows, nr)
        o = scratch(xp, "o", (nr, h), dt)
        self._proj(ctx, m["o"], o, cb)
        ob = self._bias(m["o"], s.o_bias)
        if s.sandwich:                              # Gemma: norm the output, then add
            ob = vx.post_norm(self, o, ob, m["norm_pa"])
        ab = self._norm_bits(x.shape)
        if s.pre_norm:
            a = self._residual_norm(o, ob, x, m["norm2"], a, ab)
        else:
            a = self._residual_norm(o, ob, x, m["norm1"], x, ab)
        if self._mlp_transposed_ok(m, a.shape[0]):
            self._mlp_transposed(a, m, x)
            return
        inter = scratch(xp, "inter", (nr, s.intermediate_size), dt)
        ib = None                                   # the bits of inter (model.matmul bfloat16)
        if s.gated:
            gu = scratch(xp, "gate_up", (nr, 2 * s.intermediate_size), dt)
            ib = self._norm_bits(inter.shape)
            gated_act(gu, *vx.project_gate_up(self, a, m, gu, ab), s.act, inter, ib)
        else:
            self._proj(a, m["up"], inter, ab)
            ub = self._bias(m["up"], s.mlp_bias)
            bias_act(inter, ub if ub is not None else xp.zeros(inter.shape[1], dt), s.act)
        down = scratch(xp, "down", (nr, h), dt)
        self._proj(inter, m["down"], down, ib)
        db = self._bias(m["down"], s.mlp_bias)
        if s.sandwich:
            db = vx.post_norm(self, down, db, m["norm_pm"])
        if s.pre_norm:
            residual_add(down, db, x)
        else:
            self._residual_norm(down, db, x, m["norm2"], x)

    def _attend(self, i: int, q, kc, vc, maskf, scale: float, past: int, rows, nr: int):
        """Attention of queries q (B, nh, T, d) at ``past``.. against kc, vc (B, nkv, L, d):
        batched products and :func:`attn_softmax`. Returns (ctx (nr, nh d): the rows
        ``rows``, or all; its bfloat16 bits when the GPU's kernel wrote them, or None)."""
        xp, s, dt = self.xp, self.config, self.dtype
        b, nh, t, d = q.shape
        nkv = kc.shape[1]
        g, nq, tk = nh // nkv, nh * d, past + t
        sc = scratch(xp, "scores", (b, nkv, g * t, tk), dt)
        self._bmm(q.reshape(b, nkv, g * t, d), kc[:, :, :tk].transpose(0, 1, 3, 2), sc)
        if s.attn_softcap:                          # c * tanh(scale * s / c), then softmax
            scale = vx.softcap(sc, s.attn_softcap, scale)
        attn_softmax(sc.reshape(b * nkv, g, t, tk), maskf, scale, nkv, past, s.window(i))
        if xp is np or dt != np.float32:
            ctx = scratch(xp, "ctx", (b, t, nh, d), dt)
            view = ctx.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)
            matmul_into(sc.reshape(b, nkv, g, t, tk), vc[:, :, None, :tk], view)
            ctx = ctx.reshape(b * t, nq)
            return (ctx if rows is None else ctx[rows]), None
        # one strided-batched GEMM into (b, nkv, g*t, d), then the (real) rows out of it
        tmp = scratch(xp, "ctx_heads", (b, nkv, g * t, d), dt)
        batched_matmul_f32(sc, vc[:, :, :tk], tmp)
        cb = self._norm_bits((nr, nq))
        return heads_to_rows(tmp, rows, t, g, scratch(xp, "ctx", (nr, nq), dt), cb), cb

    #: a generated token's blocks one compiled call each where :mod:`semzo.model.decode`
    #: takes them (False: block by block; the two agree to float32 rounding)
    decode_compiled = True

    #: the CPU's gated MLP computed transposed (:meth:`_mlp_transposed`); False: row layout
    mlp_transposed = True

    def _mlp_transposed_ok(self, m: dict, rows: int) -> bool:
        """Whether :meth:`_mlp_transposed` computes block ``m``'s MLP: on the CPU in float32
        products, a gated pre-norm MLP without biases, sandwich norms or LoRA on its
        projections, weights stored (out, in); not for a few rows, which read the weights in
        place (:meth:`_gemv_rows`)."""
        s = self.config
        if self._gemv_rows(rows):
            return False
        if not (self.mlp_transposed and self.xp is np and self.matmul != "bfloat16" and
                self.dtype == np.float32 and self.layout == "out_in" and s.gated and
                s.pre_norm and not s.mlp_bias and not s.sandwich):
            return False
        return not any(m[k] in self.lora for k in ("gate", "up", "gate_up", "down") if k in m)

    def _mlp_transposed(self, a, m: dict, x) -> None:
        """``x += down(act(gate(a)) * up(a))`` with every product transposed: ``W @ a.T``
        (I, N) for gate and up, the activation on that layout, ``W_down @ inter.T`` (H, N),
        and the residual added transposed. Each output element is the same dot product over
        the same inner dimension in the same order, so the bits are the row layout's
        (``tests/test_decoder_parity.py`` compares them), and OpenBLAS's sgemm packs an
        untransposed weight faster: SmolLM2's MLP of 512 tokens on one thread 28.4 ms against
        30.0 (the products alone 27.6 against 29.2; 2026-11-28, AMD EPYC)."""
        s, i_, h = self.config, self.config.intermediate_size, self.config.hidden_size
        nr = a.shape[0]
        gut = scratch(np, "gate_up_t", (2 * i_, nr), np.float32)
        if "gate_up" in m:
            np.matmul(self.fweight(m["gate_up"] + ".weight"), a.T, out=gut)
        else:
            np.matmul(self.fweight(m["gate"] + ".weight"), a.T, out=gut[:i_])
            np.matmul(self.fweight(m["up"] + ".weight"), a.T, out=gut[i_:])
        intert = scratch(np, "inter_t", (i_, nr), np.float32)
        # elementwise: [gate | up] as one row of 2 I N values (the gate's rows, then the up's)
        gated_act(gut.reshape(1, -1), None, None, s.act, intert.reshape(1, -1))
        downt = scratch(np, "down_t", (h, nr), np.float32)
        np.matmul(self.fweight(m["down"] + ".weight"), intert, out=downt)
        residual_add_t(downt, x)

    def _bmm(self, a, b, out) -> None:
        """``out[...] = a @ b`` over batch dimensions: on the GPU in float32 one
        strided-batched cuBLAS call (:func:`semzo.model.gemm.batched_matmul_f32`), else
        :func:`matmul_into`."""
        if self.xp is not np and out.dtype == np.float32 and out.flags.c_contiguous:
            batched_matmul_f32(a, b, out)
        else:
            matmul_into(a, b, out)

    # ------------------------------------------------------------------ heads
    def untie_head(self) -> None:
        """Give a tied model its own LM head matrix, a copy of the embedding matrix (the same
        logits), so that rows of the head can change without changing the inputs'
        embeddings; the config (and the exported config.json) then says
        ``tie_word_embeddings = false``. Nothing for an untied model."""
        s = self.config
        if not s.tied:
            return
        emb = self.prefix + s.names.embed
        self.config = replace(s, tied=False, raw={**s.raw, "tie_word_embeddings": False})
        name = s.names.lm_head
        self.params[name] = self.params[emb].copy()
        self._stage_of[name] = self.n_stages - 1
        if emb in self.frozen:
            self.frozen.add(name)

    def head_weight_name(self) -> str:
        """Name of the LM head matrix (V, E) in ``params``: the embedding matrix when tied."""
        s = self.config
        return self.prefix + s.names.embed if s.tied else s.names.lm_head

    def _head_weight(self):
        """The LM head matrix as :meth:`_head` takes it: float32 (bfloat16 storage: upcast),
        or with ``matmul == "bfloat16"`` the stored bfloat16 bits."""
        if self.matmul == "bfloat16":
            return self.params[self.head_weight_name()]
        return self.fparam(self.head_weight_name())

    _head_w = _head_weight

    def _head(self, hs2, w=None, out=None):
        """float32 logits (N, V) of final hidden states (N, E); ``out``: a C-contiguous
        float32 (N, V) to write them into (the same sgemm, so the same bits)."""
        if w is None and self._gemv_rows(hs2.shape[0], True):     # a few rows: in place
            w = self.params[self.head_weight_name()]
            o = out if out is not None else np.empty((hs2.shape[0], w.shape[0]), np.float32)
            z = gemv_f32(hs2, w, o) if gemv_f32_usable(hs2, w, o) else \
                np.matmul(hs2, to_float32(w).T, out=o)
        elif (w := self._head_weight() if w is None else w).dtype == BF16:
            z = matmul_bf16(hs2, w, out if out is not None else     # model.matmul bfloat16
                            self.xp.empty((hs2.shape[0], w.shape[0]), self.xp.float32))
        elif out is not None and hs2.dtype == np.float32 and w.dtype == np.float32:
            z = np.matmul(hs2, w.T, out=out)
        else:
            z = (hs2 @ w.T).astype(self.xp.float32, copy=False)
            if out is not None:
                out[...] = z
                z = out
        if self.config.final_softcap:
            vx.softcap(z, self.config.final_softcap)
        return z

    def logits(self, input_ids, attention_mask=None):
        """Next-token logits (B, T, V) float32."""
        hs = self.hidden_states(input_ids, attention_mask)
        b, t, e = hs.shape
        if self.xp is not np:
            return self._split(lambda sl: self._head(hs[sl].reshape(-1, e)).reshape(
                hs[sl].shape[0], t, -1), b, t)
        # each row block's logits straight into its rows of one array: no concatenation
        # (a copy of B x T x V floats: 0.2 GB for SmolLM2 at 8 x 128)
        # the head weight read once (for bfloat16 storage an upcast of V x E: once, not per
        # row block)
        # the array of the previous call when its caller has let go of it (OutputCache)
        w = self._head_weight()
        out = self._logits_out.get((b, t, w.shape[0]), np.float32)

        def part(sl):
            rows = out[sl]
            self._head(hs[sl].reshape(-1, e), w, out=rows.reshape(-1, rows.shape[-1]))

        self._split(part, b, t, collect=False)
        return out

    # ------------------------------------------------------------------ generation
    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for ``batch`` rows and up to ``max_len`` tokens."""
        xp, s = self.xp, self.config
        if max_len > s.max_positions:
            raise ValueError(f"cache of {max_len} tokens exceeds the model's "
                             f"{s.max_positions} positions")
        shape = (batch, s.num_kv_heads, max_len, s.head_dim)
        return KVCache([xp.zeros(shape, self.dtype) for _ in range(s.num_layers)],
                       [xp.zeros(shape, self.dtype) for _ in range(s.num_layers)],
                       xp.zeros((batch, max_len), xp.float32), xp.zeros(batch, xp.int64))

    def _check_cache(self, cache: KVCache) -> None:
        """ValueError unless ``cache`` has this model's layout (:meth:`new_cache`'s): the
        kernels that append to it do not check bounds."""
        s = self.config
        want = (cache.maskf.shape[0], s.num_kv_heads, cache.maskf.shape[1], s.head_dim)
        if len(cache.k) != s.num_layers or len(cache.v) != s.num_layers or any(
                a.shape != want or a.dtype != self.dtype or not a.flags.c_contiguous
                for a in (*cache.k, *cache.v)):
            raise ValueError(f"the KV cache does not fit this model: {s.num_layers} layers of "
                             f"{want} {self.dtype} wanted (make it with new_cache)")

    def forward_cached(self, ids_new, cache: KVCache, attention_mask=None):
        """Logits (B, t, V) float32 of ``ids_new`` (B, t), attending to the cached tokens and
        each other; appends their keys and values. ``attention_mask`` (B, t) marks new
        padding (default all 1). Positions continue from ``cache.length`` when nothing is
        padded; in general from each row's count of real tokens (see :meth:`_positions`), so
        a batch of right-padded prompts of different lengths generates, row by row, what each
        prompt alone generates."""
        ids, maskf = self._inputs(ids_new, attention_mask)
        b, t = ids.shape
        past = cache.length
        if b != cache.maskf.shape[0] or past + t > cache.maskf.shape[1]:
            raise ValueError(f"{b} x {t} new tokens do not fit a cache of "
                             f"{tuple(cache.maskf.shape)} holding {past}")
        self._check_cache(cache)
        cache.maskf[:, past:past + t] = maskf
        pos = self._positions(maskf, past, cache.seen)
        cache.seen += (maskf > 0).sum(axis=1).astype(cache.seen.dtype)
        cm = cache.maskf[:, :past + t]
        x = self._embed(ids, pos).reshape(b * t, -1)
        rows = self._pack_rows(maskf)
        if not decode.run(self, x, cm, pos, rows, cache, past):    # one compiled call, or
            self._blocks(range(self.config.num_layers), x, cm, pos, rows, cache, past)
        cache.length = past + t
        return self._head(self._final(x)).reshape(b, t, -1)

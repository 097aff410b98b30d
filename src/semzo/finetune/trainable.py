"""Which parameters train: the deck's ``train.params`` (``all``, ``head+last``, ``lora``)
applied to a model (:func:`select_trainable`), and the first trained block (the frozen prefix
below it can be computed once)."""

from __future__ import annotations

import re

from ..model.base import BLOCK
from ..runtime import AllRanksError


def default_lora_targets(model) -> tuple[str, ...] | None:
    """MeZO's choice on decoders: q and v (``q_proj``/``v_proj``; the fused ``c_attn`` of
    GPT-2 and ``qkv_proj`` of Phi-3, which hold q, k and v in one matrix); None (every
    attention projection) for encoders."""
    if model.kind != "decoder":
        return None
    mods = model.lora_modules()
    if any(m.endswith("q_proj") for m in mods):
        return ("q_proj", "v_proj")
    for fused in ("c_attn", "qkv_proj"):
        if any(m.endswith(fused) for m in mods):
            return (fused,)
    return None


def _final_norm_names(model) -> set[str]:
    """A decoder's final norm (+ OPT's project_out): the last stage's tensors but the LM head
    and the classifier; GPT-2 without the stage API: ``ln_f``."""
    if hasattr(model, "stage_names") and hasattr(model, "n_stages"):
        return {n for n in model.stage_names(model.n_stages - 1)
                if n != "lm_head.weight" and not n.startswith("classifier.") and
                n not in model.frozen}
    return {n for n in model.params if re.search(r"(?:^|\.)ln_f\.", n)}


def select_trainable(model, params: str, last_layers: int = 1, lora_rank: int = 8,
                     lora_alpha: float = 16.0, seed: int = 0, targets: tuple = (),
                     src: str = "<deck>", lora_layers: int = 0,
                     lora_a: str = "train") -> list[str]:
    """Freeze everything but the chosen subset; return the trainable names (model order).

    ``all``: every tensor the forward pass uses (and the head); ``head+last``: the head
    (``classifier.*``) plus blocks ``L - last_layers .. L - 1`` (and a decoder's final norm);
    ``lora``: LoRA adapters of rank ``lora_rank`` on the projections named by ``targets``
    (suffixes; empty = :func:`default_lora_targets`) in the last ``lora_layers`` blocks (0 =
    all) plus the head; ``lora_a = "frozen"``: the adapters' A matrices keep their random
    initialization and only B trains (LoRA-FA, Zhang et al. 2023).
    """
    if params == "lora":
        tg = tuple(targets) or default_lora_targets(model)
        if lora_layers > 0:
            first = model.config.num_layers - min(lora_layers, model.config.num_layers)
            tg = tuple(m for m in model.lora_modules()
                       if (tg is None or m.endswith(tg)) and
                       (b := BLOCK.search(m + ".")) and int(b.group(1)) >= first)
        try:
            new = model.add_lora(rank=lora_rank, alpha=lora_alpha, seed=seed, targets=tg)
        except ValueError:
            have = sorted({m.rsplit(".", 1)[-1] for m in model.lora_modules()})
            raise AllRanksError(f"{src}: train.lora_targets: no projection of this model ends "
                              f"with {', '.join(tg or ())} (its projections end with "
                              f"{', '.join(have)})") from None
        if lora_a == "frozen":
            model.frozen |= {sp.a for sp in model.lora.values() if sp.a in new}
        elif lora_a != "train":
            raise ValueError(f"unknown lora_a {lora_a!r}")
    elif params == "head+last":
        n_layers = model.config.num_layers
        first = n_layers - min(last_layers, n_layers)
        keep = _final_norm_names(model) if last_layers > 0 else set()
        for name in model.params:
            m = BLOCK.search(name)
            if name.startswith("classifier.") or (m and int(m.group(1)) >= first and
                                                 name not in model.frozen):
                keep.add(name)
        model.frozen |= set(model.params) - keep
    elif params != "all":
        raise ValueError(f"unknown trainable subset {params!r}")
    names = [n for n, _ in model.named_parameters()]
    if not names:
        raise AllRanksError(f"train.params = {params!r} with last_layers = {last_layers} leaves "
                          f"nothing to train for this model and task")
    return names


def first_trained_block(model, names: list[str], t, task_kind: str) -> int:
    """The first block that trains when the embeddings and every block below it are frozen
    (an encoder, a classification task, ``head+last``, no LoRA, a nonzero prefix cache
    budget); 0 when nothing can be cached."""
    if (task_kind != "classify" or model.kind != "encoder" or model.lora or
            t.params != "head+last" or t.prefix_cache_mb <= 0):
        return 0
    blocks = [int(m.group(1)) for n in names if (m := BLOCK.search(n))]
    if not blocks or any(".embeddings." in f".{n}" for n in names):
        return 0
    return min(blocks)

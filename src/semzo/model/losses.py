"""Input checks, pooling and the cross-entropy of the model heads (shared by every family,
NumPy or CuPy through ``xp``). The CPU next-token loss of the decoders has its own kernel
(:func:`semzo.model.kernels_lm.token_nll`)."""

from __future__ import annotations

from semzo.runtime import SemzoError


class TokenIdError(SemzoError, ValueError):
    """A token id outside the model's vocabulary (a ValueError; exit 2 from the command line,
    since the ids come from the user's tokenizer and data)."""


def check_ids(xp, ids, vocab_size: int, what: str = "token id") -> None:
    """Raise :class:`TokenIdError` naming the first token id outside [0, vocab_size) (padded positions
    included): the embedding kernels index with them. One reduction (a device sync on GPU).
    ``what`` names the ids in the message (token type ids use the same check)."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        where = tuple(int(i) for i in xp.argwhere(ids == bad)[0])
        raise TokenIdError(f"{what} {bad} at position {where} is outside the vocabulary "
                         f"of {vocab_size} ids")


def check_labels(labels, n_classes: int) -> None:
    """Raise :class:`TokenIdError` for a class label outside [0, n_classes): NumPy would wrap
    a negative one silently, CuPy any (labels are read from the data files)."""
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
        raise TokenIdError(f"label {bad} is outside the {n_classes} classes of the head")


def mean_pool(xp, hs, maskf, normalize: bool):
    """Masked mean over axis 1 of hs (B, T, H) in float32; optional L2 normalization."""
    m = maskf[:, :, None]
    s = (hs.astype(xp.float32, copy=False) * m).sum(axis=1)
    cnt = xp.maximum(maskf.sum(axis=1, keepdims=True), 1e-9)
    out = (s / cnt).astype(xp.float32, copy=False)
    if normalize:
        nrm = xp.sqrt((out * out).sum(axis=1, keepdims=True))
        out /= xp.maximum(nrm, 1e-12)
    return out


def _ce_rows(xp, logits, labels):
    """Per-row cross-entropy and hit (float64 arithmetic) of logits (N, C) against labels (N,)."""
    z = logits.astype(xp.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    pick = xp.take_along_axis(z, labels[:, None], axis=1)[:, 0]
    hit = (xp.argmax(z, axis=1) == labels).astype(xp.float64)
    return lse - pick, hit


def cross_entropy(xp, logits, labels, weights=None) -> tuple[float, float]:
    """Mean cross-entropy (float64 arithmetic) and accuracy of logits (N, C) against labels (N,).

    ``weights`` (N,) of 0/1 selects the rows that count (default: all).
    """
    nll, hit = _ce_rows(xp, logits, labels)
    if weights is None:
        return float(nll.mean()), float(hit.mean())
    w = weights.astype(xp.float64)
    n = max(float(w.sum()), 1.0)
    return float((nll * w).sum()) / n, float((hit * w).sum()) / n


def cross_entropy_sums(xp, logits, labels, weights):
    """The weighted sums (cross-entropy, hits) as a float64 array (2,) of ``xp``, left on the
    device (no synchronization): callers add them up over chunks and read them once."""
    nll, hit = _ce_rows(xp, logits, labels)
    w = weights.astype(xp.float64)
    return xp.stack([(nll * w).sum(), (hit * w).sum()])

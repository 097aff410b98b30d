"""``semzo generate MODEL_OR_CHECKPOINT --prompt TEXT``: text generation with a decoder.

Sources: a Hugging Face folder (or a named model such as ``smollm2``), a GGUF file (converted
in memory with :mod:`semzo.model.gguf`; nothing is written), or a semzo checkpoint (file, or a
run or checkpoint folder: its ``best.h5``, the best held-out model, when there, else the newest
valid checkpoint): its stored deck names the base model folder, whose checksum the checkpoint
records (``model_meta``: ``model_folder``, ``model_checksum``); a missing or different folder is
an error. The checkpoint's trained tensors (LoRA adapters included) then replace the base ones.

Decoding: greedy (``temperature = 0``) or sampling (temperature, nucleus ``top_p``, a seeded
``numpy.random.Generator``), with the model's KV cache (``new_cache`` / ``forward_cached``)
when it has one, else full recomputation; stops at an end-of-sequence id (``eos_token_id`` of
config.json and generation_config.json) or after ``max_new_tokens``. Several ``--prompt``
options: ``--batch`` of them (default 8) generated together in one cache
(:func:`generate_many`), each as it would be alone; printed as JSON lines ``{"prompt",
"text"}`` in the order given. ``chat``: the prompt is
rendered as one user message with the ``chat_template`` of tokenizer_config.json (jinja2).

Arithmetic: ``--matmul bfloat16`` (with bfloat16 weights) computes the projections and the
LM head as bfloat16 GEMMs with float32 accumulation (``model.matmul``; on CPUs with
AVX512_BF16 the dot-product kernels of :mod:`semzo.model.gemm_cpu`, whose few-row form serves
each generated token); a checkpoint generates with the ``model.matmul`` its deck trained and
evaluated with, unless ``--matmul`` says otherwise; anything else with float32.

``device = "gpu"`` (``--device gpu``): the model is built on the host as above, then its
tensors are copied to the first visible GPU (:func:`to_device`) and the forward passes and
the KV cache run there (CuPy); the sampling stays on the host.

Runs on one process; nothing here is collective.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI
from tokenizers import Tokenizer as HFTokenizer

from .checkpoint import modelfile
from .checkpoint.format import CheckpointError
from .checkpoint.manager import find_model_checkpoint
from .checkpoint.reader import load
from .checkpoint.tools import checkpoint_dtype, rebuild_model, take_label_rows
from .deck import from_toml_text
from .model import families, load_model
from .model.causal import CausalLM, expected_tensors
from .model.chat import chat_template, render_chat
from .model.gguf import GGUFModel
from .model.gguf_tokenizer import build_tokenizer
from .model.label_rows import apply_to_model
from .model.storage import STORAGE, same_storage_copy, to_storage
from .model.zoo import NAMED, folder_checksum, resolve_model_path
from .runtime import SemzoError


@dataclass
class Loaded:
    model: object
    tk: object            # tokenizers.Tokenizer (no truncation, no padding)
    tok_config: dict      # tokenizer_config.json (chat_template, bos/eos tokens)
    eos_ids: set
    what: str
    matmul: str = "float32"   # the arithmetic a checkpoint's deck trained with (model.matmul)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise SemzoError(f"{path}: not valid JSON ({exc})") from None


def _eos(*cfgs: dict) -> set:
    out: set = set()
    for c in cfgs:
        e = c.get("eos_token_id")
        if isinstance(e, int):
            out.add(e)
        elif isinstance(e, list):
            out |= {int(x) for x in e if isinstance(x, int)}
    return out


def _from_folder(folder: Path, what: str, dtype: str = "float32") -> Loaded:


    model = load_model(folder, dtype=dtype)
    if model.kind != "decoder":
        raise SemzoError(f"{folder}: generate needs a decoder, got an {model.kind}")
    f = folder / "tokenizer.json"
    if not f.is_file():
        raise SemzoError(f"{f}: not found (generate needs a tokenizer.json)")
    tk = HFTokenizer.from_file(str(f))
    tk.no_truncation()
    tk.no_padding()
    return Loaded(model, tk, _json(folder / "tokenizer_config.json"),
                  _eos(_json(folder / "config.json"),
                       _json(folder / "generation_config.json")), what)


def _from_gguf(path: Path, dtype: str = "float32") -> Loaded:

    g = GGUFModel(path)
    cfg = g.hf_config()
    plan = g.plan(cfg)
    fam = families.find(cfg)
    if fam is None:
        raise SemzoError(f"{path}: architecture {cfg.get('architectures')} has no semzo family")
    spec = families.read_spec(fam, cfg, path)
    have = {hf for hf, _, _ in plan}
    prefix = next((p for p in fam.PREFIXES if p + spec.names.embed in have), None)
    if prefix is None:
        raise SemzoError(f"{path}: no embedding tensor {spec.names.embed!r}")
    by_hf = {hf: gname for hf, gname, _ in plan}
    params = {}
    for name, shape, _ in expected_tensors(spec, prefix):
        if name not in by_hf:
            raise SemzoError(f"{path}: missing tensor {name!r}")
        arr = np.ascontiguousarray(g.hf_tensor(by_hf[name], cfg), np.float32)
        if tuple(arr.shape) != tuple(shape):
            raise SemzoError(f"{path}: {name} has shape {arr.shape}, expected {shape}")
        params[name] = to_storage(arr, STORAGE[dtype])
    model = CausalLM(spec, params, {}, set(), np, dtype, None, prefix)
    tk, tok_cfg = build_tokenizer(g, cfg)
    tk.no_truncation()
    tk.no_padding()
    return Loaded(model, tk, tok_cfg, _eos(cfg), f"{path} (GGUF, converted in memory)")


def _from_checkpoint(path: Path, dtype: str | None = None) -> Loaded:

    comm = MPI.COMM_SELF
    if path.is_dir():
        found, _which = find_model_checkpoint(path, comm)   # best.h5 first
        if found is None:
            raise SemzoError(f"{path}: no valid checkpoint in this folder")
        path = found
    try:
        loaded = modelfile.read(path, comm) if modelfile.is_model_file(path) else load(path, comm)
    except CheckpointError as exc:
        raise SemzoError(str(exc)) from None
    meta = json.loads(loaded.attrs.get("model_meta") or "{}")
    deck = from_toml_text(loaded.deck_toml) if loaded.deck_toml.strip() else None
    name = deck.model.path if deck is not None else ""
    if not name:
        raise SemzoError(f"{path}: its deck names no decoder in model.path")
    recorded = meta.get("model_folder") or name
    folder = resolve_model_path(recorded) if recorded == name else Path(recorded)
    if not (folder / "config.json").is_file():
        raise SemzoError(f"{path}: its model folder {folder} is missing (the checkpoint was "
                         f"trained from it; restore it or export the checkpoint elsewhere)")
    want = meta.get("model_checksum")
    if want and folder_checksum(folder) != want:
        raise SemzoError(f"{path}: the model folder {folder} differs from the one the "
                         f"checkpoint was trained from (checksum {folder_checksum(folder)}, "
                         f"recorded {want})")
    dt = checkpoint_dtype(deck, dtype, path)
    base = _from_folder(folder, "", dt)
    base.matmul = deck.model.matmul
    rows = take_label_rows(loaded)          # train.label_rows = "exact"
    model = rebuild_model(loaded, meta)
    if model.kind != "decoder":
        raise SemzoError(f"{path}: generate needs a decoder, the checkpoint's model is an "
                         f"{model.kind}")
    for n, arr in loaded.params.items():
        if n not in model.params or model.params[n].shape != arr.shape:
            raise SemzoError(f"{path}: tensor {n!r} does not fit the model")
        try:
            same_storage_copy(model.params[n], arr, f"{path}: {n}")
        except ValueError as exc:
            raise SemzoError(str(exc)) from None
    if rows is not None:
        apply_to_model(model, *rows, str(path))
    base.model = model
    base.what = f"{path} (step {loaded.step}, base model {folder})"
    return base


def load_for_generation(source: str, dtype: str | None = None,
                        matmul: str | None = None) -> Loaded:
    """A decoder, its tokenizer and end-of-sequence ids from a folder, a named model, a GGUF
    file or a semzo checkpoint (see the module docstring). ``dtype``: weight storage,
    "float32" (default) or "bfloat16" (CPU: float16 is GPU only); a checkpoint's model is
    rebuilt with the storage it was trained with (:func:`checkpoint_dtype`). ``matmul``: the
    GEMMs' arithmetic (``model.matmul``), by default a checkpoint's own, else "float32".
    Raises :class:`SemzoError`."""
    loaded = _load(source, dtype)
    mode = matmul or loaded.matmul
    try:
        loaded.model.set_matmul(mode)
    except ValueError as exc:
        flag = "--matmul" if matmul else f"{loaded.what}: its deck's model.matmul"
        raise SemzoError(f"{flag} {mode}: {exc}; for bfloat16 GEMMs load bfloat16 weights "
                         f"(--dtype bfloat16)") from None
    loaded.matmul = mode
    return loaded


def _load(source: str, dtype: str | None) -> Loaded:
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise SemzoError(f"--dtype {dtype}: generate stores float32 or bfloat16 weights (the "
                         f"model is built on the host, which refuses float16)")
    p = Path(source)
    if source in NAMED:
        folder = resolve_model_path(source)
        return _from_folder(folder, f"{source} ({folder})", dtype or "float32")
    if p.is_file() and p.suffix == ".gguf":
        return _from_gguf(p, dtype or "float32")
    if p.is_file() and p.suffix == ".h5":
        return _from_checkpoint(p, dtype)
    if p.is_dir() and (p / "config.json").is_file():
        return _from_folder(p, str(p), dtype or "float32")
    if p.is_dir() and (any(p.glob("ckpt-*.h5")) or (p / "best.h5").is_file()
                       or (p / "checkpoints").is_dir()):
        return _from_checkpoint(p / "checkpoints" if (p / "checkpoints").is_dir() else p, dtype)
    if not p.exists():
        raise SemzoError(f"{source}: no such model folder, GGUF file or checkpoint")
    raise SemzoError(f"{source}: not a model folder (config.json), a .gguf file or a semzo "
                     f"checkpoint (.h5 or a folder of them)")


def to_device(model, xp):
    """A copy of the decoder ``model`` with its tensors on ``xp`` (CuPy: the current GPU):
    the same class rebuilt from the same spec, storage and prefix (caches made anew), its LoRA
    and head specs carried; trained rows already applied travel with the head's tensor."""
    moved = type(model)(model.config, {n: xp.asarray(a) for n, a in model.params.items()},
                        {n: xp.asarray(b) for n, b in model.buffers.items()}, model.frozen,
                        xp, model.storage, model.source, model.prefix)
    moved.lora, moved.head = dict(model.lora), model.head
    moved.set_matmul(model.matmul)
    return moved


def _on_gpu(loaded: Loaded) -> None:
    """``--device gpu``: bind the first visible GPU and move the model there."""
    from .backend import bind_gpu
    try:
        bind_gpu(0, asked="generate --device gpu")
    except RuntimeError as exc:
        raise SemzoError(str(exc)) from None
    import cupy  # bound: it imports
    loaded.model = to_device(loaded.model, cupy)


def chat_prompt(loaded: Loaded, text: str, variables: dict | None = None) -> str:
    """``text`` as one user message through the model's chat template (generation prompt
    added, today's date for ``strftime_now``, ``variables`` (``--chat-var``) passed to the
    template; :func:`semzo.model.chat.render_chat`, the
    renderer the ``sft`` task uses). A model
    without a template, or no jinja2, is a :class:`SemzoError`."""
    if not chat_template(loaded.tok_config, loaded.what):
        raise SemzoError(f"{loaded.what}: --chat: the model has no chat_template in "
                         f"tokenizer_config.json")
    return render_chat(loaded.tok_config, [{"role": "user", "content": text}], True,
                       loaded.what, today=True, variables=variables)


def sample_next(logits: np.ndarray, temperature: float, top_p: float,
                rng: np.random.Generator) -> int:
    """Next token id from float logits (V,): argmax when ``temperature <= 0``, else a draw
    from softmax(logits / temperature) restricted to the smallest set of tokens whose
    probability reaches ``top_p`` (the most likely token always kept)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[:int(np.searchsorted(cum, top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(p.size, p=p))


def host(a) -> np.ndarray:
    """A NumPy array of ``a`` (a CuPy array copied to the host)."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def generate_ids(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, eos_ids=frozenset()) -> list[int]:
    """Generated token ids (the prompt excluded; an end-of-sequence id that stops generation is
    included). Uses the KV cache when the model has one."""
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise SemzoError("--prompt: the prompt encodes to no tokens")
    limit = int(model.config.max_positions)
    if len(ids) >= limit:
        raise SemzoError(f"--prompt: {len(ids)} tokens, the model's context is {limit}")
    n_new = min(max_new_tokens, limit - len(ids))
    out: list[int] = []
    cache = model.new_cache(1, len(ids) + n_new) if hasattr(model, "new_cache") else None
    if cache is not None:
        logits = host(model.forward_cached(np.array([ids], np.int64), cache)[0, -1])
    else:
        logits = host(model.logits(np.array([ids], np.int64))[0, -1])
    for _ in range(n_new):
        nxt = sample_next(logits, temperature, top_p, rng)
        out.append(nxt)
        if nxt in eos_ids or len(out) == n_new:
            break
        if cache is not None:
            logits = host(model.forward_cached(np.array([[nxt]], np.int64), cache)[0, -1])
        else:
            logits = host(model.logits(np.array([ids + out], np.int64))[0, -1])
    return out


def generate_many(model, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, eos_ids=frozenset(),
                  batch: int = 8) -> list[list[int]]:
    """:func:`generate_ids` for each prompt (lists of ids), ``batch`` prompts at a time in
    one KV cache: the prompts right-padded and masked, then one token a row a step, so each
    step reads every weight once for all the rows (decoding is bound by memory: several rows
    cost about what one does). Each row samples with its own generator seeded ``seed``, as
    alone; a row that has ended feeds its last token until the others end (never read).
    Without a KV cache, prompt by prompt. Returns the generated ids of each prompt."""
    if batch < 1:
        raise SemzoError(f"--batch: must be >= 1, got {batch}")
    if not hasattr(model, "new_cache") or batch == 1:
        return [generate_ids(model, p, max_new_tokens, temperature=temperature, top_p=top_p,
                             seed=seed, eos_ids=eos_ids) for p in prompts]
    outs: list[list[int]] = []
    for lo in range(0, len(prompts), batch):
        outs += _generate_batch(model, [list(map(int, p)) for p in prompts[lo:lo + batch]],
                                max_new_tokens, temperature, top_p, seed, eos_ids)
    return outs


def _generate_batch(model, prompts, max_new_tokens, temperature, top_p, seed, eos_ids):
    limit = int(model.config.max_positions)
    for p in prompts:
        if not p:
            raise SemzoError("--prompt: a prompt encodes to no tokens")
        if len(p) >= limit:
            raise SemzoError(f"--prompt: {len(p)} tokens, the model's context is {limit}")
    n_new = [min(max_new_tokens, limit - len(p)) for p in prompts]
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t), np.int64)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
        mask[r, :len(p)] = 1
    cache = model.new_cache(b, t + max(n_new))
    z = host(model.forward_cached(ids, cache, mask))
    logits = [z[r, len(p) - 1] for r, p in enumerate(prompts)]
    rngs = [np.random.default_rng(seed) for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * b
    while not all(done):
        nxt = np.zeros((b, 1), np.int64)
        for r in range(b):
            if not done[r]:
                tok = sample_next(logits[r], temperature, top_p, rngs[r])
                outs[r].append(tok)
                done[r] = tok in eos_ids or len(outs[r]) == n_new[r]
            nxt[r, 0] = outs[r][-1]
        if all(done):
            break
        z = host(model.forward_cached(nxt, cache))
        logits = [z[r, -1] for r in range(b)]
    return outs


#: the variables semzo itself passes to a chat template (not settable by --chat-var)
CHAT_OWN_VARS = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def chat_vars(items: list[str], chat: bool) -> dict:
    """``--chat-var KEY=VALUE`` options as template variables: VALUE parsed as JSON when it
    parses (``false``, ``3``, ``"x"``, ``[...]``), else taken as a string; ValueError naming
    the item for one without ``=``, a key that is not an identifier, one of
    :data:`CHAT_OWN_VARS`, a key given twice, or any without ``--chat``."""
    out: dict = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"{item!r}: expected KEY=VALUE with KEY a name")
        if key in CHAT_OWN_VARS or key in out:
            raise ValueError(f"{item!r}: {key} is "
                             f"{'set by semzo' if key in CHAT_OWN_VARS else 'given twice'}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    if out and not chat:
        raise ValueError("needs --chat (the variables are the chat template's)")
    return out


def check_options(args) -> None:
    """The sampling options, before any model is loaded: :class:`SemzoError` (exit 2) naming
    the first bad one. ``nan`` and ``inf`` are refused (argparse's float() accepts them)."""
    t, p = args.temperature, args.top_p
    err = None
    if not (math.isfinite(t) and t >= 0):
        err = f"--temperature: must be a finite number >= 0 (0 = greedy), got {t}"
    elif not (math.isfinite(p) and 0 < p <= 1):
        err = f"--top-p: must be a number in (0, 1], got {p}"
    elif args.max_new_tokens < 1:
        err = f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}"
    elif args.seed < 0:
        err = f"--seed: must be >= 0, got {args.seed}"
    elif getattr(args, "batch", 1) < 1:
        err = f"--batch: must be >= 1, got {args.batch}"
    else:
        try:
            args.chat_vars = chat_vars(getattr(args, "chat_var", None) or [],
                                       getattr(args, "chat", False))
        except ValueError as exc:
            err = f"--chat-var: {exc}"
    if err:
        exc = SemzoError(f"generate: {err}")
        exc.all_ranks = True          # the command line: the same on any rank ("error: ...")
        raise exc


def run_generate(args) -> str:
    """The CLI command: load, encode (chat template on request), generate, decode."""
    check_options(args)
    loaded = load_for_generation(args.model, getattr(args, "dtype", None),
                                 getattr(args, "matmul", None))
    if getattr(args, "device", "cpu") == "gpu":
        _on_gpu(loaded)
    prompts = args.prompt if isinstance(args.prompt, list) else [args.prompt]
    ids = [loaded.tk.encode(chat_prompt(loaded, p, getattr(args, "chat_vars", None))
                            if args.chat else p,
                            add_special_tokens=not args.chat).ids for p in prompts]
    outs = generate_many(loaded.model, ids, args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         eos_ids=loaded.eos_ids, batch=getattr(args, "batch", 8))
    texts = [loaded.tk.decode([i for i in out if i not in loaded.eos_ids],
                              skip_special_tokens=True) for out in outs]
    if len(prompts) == 1:
        return texts[0]
    return "\n".join(json.dumps({"prompt": p, "text": t}, ensure_ascii=False)
                     for p, t in zip(prompts, texts))

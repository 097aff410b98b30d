"""Lazy reader of a folder's safetensors checkpoint: ``model.safetensors`` or the shards listed
in ``model.safetensors.index.json``. Tensors are read one at a time, so a model can be loaded
block by block and never holds more than one tensor beyond its parameters.

The safetensors format is parsed directly (8-byte little-endian header length, a JSON header
of name -> dtype, shape, data offsets, then the data): headers are validated (offsets inside
the file, sizes matching dtype and shape) before any byte is read, and BF16 tensors, which
NumPy cannot represent, are widened to float32 bit-exactly. Nothing is unpickled.
Every problem raises :class:`SemzoError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from semzo.runtime import SemzoError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_MAX_HEADER = 100 * 2**20


def _header(path: Path) -> tuple[dict, int, dict]:
    """(tensor entries, offset of the data, ``__metadata__``: {} when absent or not a map of
    strings) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SemzoError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise SemzoError(f"{path}: not a safetensors file (header of {n} bytes)")
            head = f.read(n)
        size = path.stat().st_size
    except FileNotFoundError:
        raise SemzoError(f"{path}: file not found") from None
    except OSError as exc:
        raise SemzoError(f"{path}: cannot read: {exc}") from None
    try:
        meta = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SemzoError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(meta, dict) or len(head) < n:
        raise SemzoError(f"{path}: not a safetensors file (truncated header)")
    user = meta.pop("__metadata__", None)
    if not (isinstance(user, dict) and all(isinstance(v, str) for v in user.values())):
        user = {}
    start = 8 + n
    for name, e in meta.items():
        try:
            dt = _DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            a, b = (int(o) for o in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SemzoError(f"{path}: tensor {name!r}: bad header entry "
                             f"(dtype {e.get('dtype') if isinstance(e, dict) else e!r})") from None
        count = int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or b - a != count * np.dtype(dt).itemsize or a < 0 or \
                start + b > size:
            raise SemzoError(f"{path}: tensor {name!r}: data offsets {a}..{b} do not match "
                             f"shape {list(shape)} {e['dtype']} within the file's {size} bytes "
                             f"(truncated or damaged file)")
    return meta, start, user


class Checkpoint(Mapping):
    """Read-only mapping name -> NumPy array over a folder's safetensors files.

    ``ckpt[name]`` reads that tensor now (BF16 -> float32; other dtypes as stored);
    ``ckpt.shape(name)``, ``ckpt.dtype(name)`` and ``ckpt.file(name)`` read nothing.
    Names are in file order (shards in index order).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        single = self.folder / "model.safetensors"
        index = self.folder / "model.safetensors.index.json"
        if single.is_file():
            files, self.source = {single: None}, single
        elif index.is_file():
            files, self.source = self._shards(index), index
        else:
            raise SemzoError(f"{self.folder}: no model.safetensors (pickle checkpoints are "
                             f"not read)")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        self.metadata: dict[str, str] = {}
        for f, expect in files.items():
            meta, start, self.metadata = _header(f)
            for name, e in meta.items():
                self._where[name] = (f, e, start)
            for name in expect or ():
                if name not in meta:
                    raise SemzoError(f"{index}: tensor {name!r} is listed in shard {f.name} "
                                     f"but that file does not hold it")

    @classmethod
    def of_file(cls, path: str | Path) -> Checkpoint:
        """One safetensors file (not a folder's model checkpoint), checked and read the same
        way; ``metadata``: its ``__metadata__``."""
        self = cls.__new__(cls)
        path = Path(path)
        self.folder, self.source = path.parent, path
        meta, start, self.metadata = _header(path)
        self._where = {name: (path, e, start) for name, e in meta.items()}
        return self

    def _shards(self, index: Path) -> dict[Path, list[str]]:
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise SemzoError(f"{index}: not a safetensors index (no weight_map object)") from None
        files: dict[Path, list[str]] = {}
        for name, fname in wm.items():
            f = self.folder / str(fname)
            if Path(str(fname)).name != str(fname):
                raise SemzoError(f"{index}: shard name {fname!r} of tensor {name!r} is not a "
                                 f"plain file name")
            if not f.is_file():
                raise SemzoError(f"{index}: shard {f} is missing (it holds tensor {name!r})")
            files.setdefault(f, []).append(name)
        return files

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where

    def file(self, name: str) -> Path:
        return self._where[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self._where[name][1]["shape"])

    def dtype(self, name: str) -> str:
        """The stored dtype code ("F32", "BF16", ...)."""
        return self._where[name][1]["dtype"]

    def __getitem__(self, name: str) -> np.ndarray:
        f, e, start = self._where[name]
        dt = np.dtype(_DTYPES[e["dtype"]]).newbyteorder("<")
        a, b = (int(o) for o in e["data_offsets"])
        shape = tuple(int(s) for s in e["shape"])
        try:
            arr = np.fromfile(f, dtype=dt, count=(b - a) // dt.itemsize, offset=start + a)
        except OSError as exc:
            raise SemzoError(f"{f}: tensor {name!r}: cannot read: {exc}") from None
        if arr.size * dt.itemsize != b - a:
            raise SemzoError(f"{f}: tensor {name!r}: file ends inside its data (truncated)")
        if e["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(arr.dtype.newbyteorder("="), copy=False).reshape(shape)

    def read(self, name: str, shape: tuple[int, ...] | None = None,
             dtype=np.float32) -> np.ndarray:
        """Tensor ``name`` as ``dtype``, checked against ``shape`` (SemzoError naming the file
        and the tensor if it is missing or of another shape)."""
        if name not in self._where:
            raise SemzoError(f"{self.folder}: checkpoint has no tensor {name!r}")
        if shape is not None and self.shape(name) != tuple(shape):
            raise SemzoError(f"{self.file(name)}: tensor {name!r} has shape "
                             f"{list(self.shape(name))}, config.json implies {list(shape)}")
        return self[name].astype(dtype, copy=False)

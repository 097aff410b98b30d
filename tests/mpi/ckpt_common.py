"""Deterministic checkpoint contents shared by the ckpt_* MPI scripts and tests.

``content(step, rank)`` gives what every rank passes to ``Checkpointer.save`` at ``step``:
parameters of many shapes and dtypes (blocks of 4 KiB make most of them span several blocks
and ranks; some are smaller than the rank count, 0-d or empty), a nested ZO state, per-rank
cursors, extras and metrics. Replicated values do not depend on the rank.
"""

from __future__ import annotations

import numpy as np

BLOCK_KIB = 4


def params(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {
        "embeddings.word_embeddings.weight": rng.standard_normal((1000, 33)).astype(np.float32),
        "encoder.layer.0.attention.self.query.bias": rng.standard_normal(3).astype(np.float32),
        "encoder.layer.0.output.dense.weight": rng.standard_normal((2, 5000)).astype(np.float32),
        "encoder.layer.0.half": rng.standard_normal((40, 3, 7)).astype(np.float16),
        "pooler.scale": np.array(float(step) + 0.25),
        "empty": np.zeros((0, 4), np.float32),
        "classifier.weight": rng.standard_normal((5, 384)).astype(np.float64),
        "position_ids": np.arange(512, dtype=np.int64).reshape(1, 512),
    }


def state(step: int) -> dict:
    rng = np.random.default_rng(2000 + step)
    return {"step": step, "lr": 1e-4 / (step + 1), "done": False, "schedule": "cosine",
            "seeds": rng.integers(0, 2**63, size=16, dtype=np.uint64),
            "history": {"seed": rng.integers(0, 2**31, size=8).tolist(),
                        "g": rng.standard_normal(8)},
            "skips": 2, "ema": np.array(0.125)}


def per_rank(step: int, rank: int) -> dict[str, np.ndarray]:
    return {"cursor": np.array([step // 3 + rank % 2, 7 * rank + step], dtype=np.int64),
            "shard_size": np.int64(100 + 3 * rank),
            "rng_counter": np.array([rank, step, 3], dtype=np.uint32)}


def extras(step: int) -> dict[str, np.ndarray]:
    return {"centroids": np.random.default_rng(3000 + step).standard_normal((6, 8))}


def metrics(step: int) -> dict:
    return {"loss": 1.0 / (step + 1), "accuracy": 0.5}


def same(a, b) -> bool:
    """Deep equality with types: arrays bit for bit (dtype and shape too)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


def locate(path, tensor: str) -> tuple[int, int]:
    """(file offset, bytes) of one tensor of a format-2 checkpoint, through its index."""
    import h5py

    with h5py.File(path, "r") as f:
        row = next(r for r in f["index"][()] if bytes(r["path"]).decode() == tensor)
        d = f["packed"][bytes(row["packed"]).decode()]
        return (d.id.get_offset() + int(row["offset"]) * d.dtype.itemsize,
                int(row["count"]) * d.dtype.itemsize)


def flip(path, offset: int, mask: int = 0x10) -> None:
    """XOR one byte of a file."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


def reseal(path) -> None:
    """Recompute a file's whole-file record after a deliberate change, so that the checks
    inside the file (block digests, attribute and index checksums) are the ones that see it."""
    import h5py

    from semzo.checkpoint import filesum

    with h5py.File(path, "r") as f:
        kind, block = str(f.attrs["checksum_kind"]), int(f.attrs["block_bytes"])
    filesum.seal(path, kind, block, [])

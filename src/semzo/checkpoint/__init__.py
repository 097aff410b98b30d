"""Checkpoints of fine-tuning: one HDF5 file per save (tensors packed into one dataset per
dtype, with an index), written collectively and atomically, checked whole on one rank before
HDF5 parses it, and verified block by block on load at any world size (docs/checkpoint.md).

Public API::

    from semzo.checkpoint import Checkpointer, find_resumable, resume, load, verify
    ck = Checkpointer(topo, deck.checkpoint, deck.run.output_dir, deck.to_toml())
    ck.maybe_save(step, params, state, per_rank, extras, metrics)   # every N steps
    ck.save(step, ...); ck.close()
    loaded = resume(ck.dir, comm, shard_size=n_local)               # newest valid, or None
"""

from .filesum import check_file
from .format import CheckpointError, manifest_checksum
from .manager import (
                      CheckpointDirError,
                      Checkpointer,
                      find_model_checkpoint,
                      find_resumable,
                      list_checkpoints,
                      read_latest,
                      resume,
)
from .reader import Loaded, load, verify
from .reshard import remap_cursors

__all__ = ["CheckpointDirError", "CheckpointError", "Checkpointer", "Loaded", "check_file",
           "find_model_checkpoint", "find_resumable", "list_checkpoints", "load", "manifest_checksum", "read_latest",
           "remap_cursors", "resume", "verify"]

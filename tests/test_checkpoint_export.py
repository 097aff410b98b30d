"""``semzo export``: a checkpoint of fine-tuned MiniLM parameters (and a classification head)
becomes a Hugging Face folder that transformers loads with exactly the checkpoint's values."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from mpi4py import MPI
from mpiutil import ROOT

from semzo import deck as deckmod
from semzo.checkpoint import Checkpointer
from semzo.deck import CheckpointSection
from semzo.model import load_model


def test_export_loads_in_transformers(tmp_path):
    model = load_model()
    model.add_classifier(3, seed=1)
    params = {n: a.copy() for n, a in model.params.items() if n not in model.frozen}
    changed = "encoder.layer.5.attention.self.query.weight"
    params[changed] += np.float32(0.01)
    params["classifier.bias"][:] = [0.5, -1.0, 2.0]
    deck_toml = deckmod.load(None).to_toml()           # model.path = "": packaged MiniLM
    with Checkpointer(MPI.COMM_SELF, CheckpointSection(dir=str(tmp_path / "ck")),
                      deck_toml=deck_toml,
                      model_meta={"head": {"n_classes": 3, "normalize": True,
                                           "label_names": ["art", "love", "work"]}}) as ck:
        path = ck.save(5, params, {"step": 5})
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "semzo", "export", str(tmp_path / "ck"),
                           str(out)], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert f"exported {tmp_path / 'ck'} to {out}" in proc.stdout
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()

    from transformers import AutoModel
    hf = AutoModel.from_pretrained(str(out))
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, arr in params.items():
        if name.startswith("classifier."):
            continue
        assert np.array_equal(sd[name], arr), name
    assert not np.array_equal(sd[changed], model.params[changed])   # the change was exported
    assert np.array_equal(sd["pooler.dense.weight"], model.params["pooler.dense.weight"])
    back = load_model(out)                                 # the head comes back with semzo
    assert back.head is not None and back.head.normalize
    assert np.array_equal(back.params["classifier.bias"], params["classifier.bias"])
    assert path.name == "ckpt-000000005.h5"
    # the label vocabulary travels with the export: config.json and the head's metadata
    import json

    from safetensors import safe_open
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["id2label"] == {"0": "art", "1": "love", "2": "work"}
    assert cfg["label2id"] == {"art": 0, "love": 1, "work": 2}
    with safe_open(str(out / "semzo_head.safetensors"), "np") as f:
        assert json.loads(f.metadata()["label_names"]) == ["art", "love", "work"]


def test_export_of_a_damaged_file_is_one_line_exit_2(tmp_path):
    """The whole-file check runs before HDF5 opens the file: one line, exit 2, no folder."""
    with Checkpointer(MPI.COMM_SELF, CheckpointSection(dir=str(tmp_path / "ck"))) as ck:
        path = ck.save(1, {"classifier.bias": np.zeros(3, np.float32)}, {"step": 1})
    with open(path, "r+b") as fh:            # the HDF5 superblock's end-of-file address
        fh.seek(4096 + 40)
        fh.write(b"\x7f")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "semzo", "export", str(path), str(out)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: damaged checkpoint: {path}: " + proc.stderr.split(f"{path}: ", 1)[1].strip()]
    assert "whole-file checksum mismatch" in proc.stderr and not out.exists()

"""Decks: validation, overrides, the resolved TOML, docs/deck.md in step with the schema."""

import dataclasses
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from mpiutil import ROOT, check, mpirun

from semzo import deck as deckmod
from semzo import deckdoc, preflight
from semzo.deck import DeckError

BAD_DECKS = [
    # (name, deck text, extra --set args, text the one-line error must contain)
    ("unknown key", "[cluster]\nkk = 3\n", [], "cluster.kk: unknown key (did you mean 'k'?)"),
    ("unknown section", "[clustr]\nk = 3\n", [], "clustr: unknown section (did you mean"),
    ("wrong type str", "[cluster]\nk = \"many\"\n", [], "cluster.k: expected an integer"),
    ("wrong type bool", "[cluster]\nspherical = 1\n", [], "cluster.spherical: expected true"),
    ("out of range", "[cluster]\nk = 0\n", [], "cluster.k: must be >= 1"),
    ("negative float", "[cluster]\ntol = -1.0\n", [], "cluster.tol: must be >= 0.0"),
    ("exclusive min", "[place]\nbalance_tol = 0.0\n", [], "place.balance_tol: must be > 0.0"),
    ("above max", "[model]\nmax_length = 1000\n", [], "model.max_length: must be <= 512"),
    ("bf16 matmul, float32 weights", "[model]\nmatmul = \"bfloat16\"\n", [],
     "model.matmul: \"bfloat16\" multiplies bfloat16 weights and needs model.dtype"),
    ("frozen A without LoRA", "[train]\nlora_a = \"frozen\"\n", [],
     "train.lora_a: \"frozen\" freezes the A matrices of LoRA adapters; train.params is"),
    ("bad choice", "[place]\nmode = \"semantik\"\n", [], "place.mode: 'semantik' is not one"),
    ("stage order", "[run]\nstages = [\"cluster\", \"embed\"]\n", [], "run.stages: stages must"),
    ("unknown stage", "[run]\nstages = [\"embedd\"]\n", [], "run.stages: 'embedd'"),
    ("missing corpus", "[corpus]\npath = \"no/such.jsonl\"\n", [], "corpus.path: file not found"),
    ("missing model", "[model]\npath = \"/no/such/model\"\n", [],
     "model.path: no such folder /no/such/model (semzo reads models from disk and downloads"),
    ("fp16 on cpu", "[model]\ndtype = \"float16\"\n", [], "model.dtype: float16"),
    ("ranks per node", "[topology]\nranks_per_node = 3\n", [], "topology.ranks_per_node: 4"),
    ("nodes per switch", "[topology]\nranks_per_node = 1\nnodes_per_switch = 3\n", [],
     "topology.nodes_per_switch: 4 nodes"),
    ("toml syntax", "[cluster\nk = 3\n", [], "TOML syntax error"),
    ("table for key", "[cluster.k]\nx = 1\n", [], "cluster.k: unexpected table"),
    ("section not table", "run = 3\n", [], "run: expected a table"),
    ("empty output", "[run]\noutput_dir = \"\"\n", [], "run.output_dir: must not be empty"),
    ("set unknown key", "", ["cluster.kay=3"], "cluster.kay: unknown key"),
    ("set bad value", "", ["run.threads=-1"], "run.threads: must be >= 0"),
    ("set no section", "", ["threads=2"], "expected section.key=value"),
    ("set nan", "", ["zo.eps=nan"], "zo.eps: must be a finite number, got nan"),
    ("set inf", "", ["zo.eps=inf"], "zo.eps: must be a finite number, got inf"),
    ("lr inf", "[zo]\nlr = inf\n", [], "zo.lr: must be a finite number, got inf"),
    ("tol -inf", "[cluster]\ntol = -inf\n", [], "cluster.tol: must be a finite number"),
    ("zo dist", "[zo]\ndist = \"gaussian_fast\"\n", [], "zo.dist: 'gaussian_fast' is not one"),
    ("zo schedule", "[zo]\nschedule = \"twopass\"\n", [], "zo.schedule: 'twopass' is not one"),
    ("zo offload", "", ["zo.offload=disk"], "zo.offload: 'disk' is not one"),
    ("offload needs streamed", "[zo]\noffload = \"host\"\nschedule = \"three-pass\"\n", [],
     "zo.offload: \"host\" streams stages and needs zo.schedule"),
]


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "hello"}\n')
    return p


def _deck(tmp_path, text, corpus):
    d = tmp_path / "deck.toml"
    base = f'[corpus]\npath = "{corpus}"\n' if "[corpus]" not in text else ""
    d.write_text(text + "\n" + base)  # top-level keys must come before any table
    return d


def test_defaults_resolve_and_roundtrip():
    d = deckmod.load(None, ["run.stages=[\"topology\"]"])
    assert d.cluster.k == 64 and d.run.stages == ("topology",)
    again = deckmod.from_toml_text(d.to_toml())
    assert again.to_dict() == d.to_dict()
    with pytest.raises(AttributeError):
        d.cluster.k = 3  # frozen


def test_override_types_and_validation(corpus):
    d = deckmod.build({"corpus": {"path": str(corpus)}}, "x.toml",
                      ["cluster.k=7", "cluster.tol=1", "place.mode=random", "run.seed=3"])
    assert (d.cluster.k, d.cluster.tol, d.place.mode, d.run.seed) == (7, 1.0, "random", 3)
    assert isinstance(d.cluster.tol, float)
    for dist in ("gaussian", "gaussian-fast", "rademacher"):
        assert deckmod.build({}, "x.toml", [f"zo.dist={dist}"]).zo.dist == dist
    with pytest.raises(DeckError, match=r"^x.toml: --set cluster.k: expected an integer"):
        deckmod.build({}, "x.toml", ["cluster.k=1.5"])


@pytest.mark.parametrize("name,text,sets,expect", BAD_DECKS, ids=[b[0] for b in BAD_DECKS])
def test_bad_deck_in_process(tmp_path, corpus, name, text, sets, expect):
    deck = _deck(tmp_path, text, corpus)
    with pytest.raises(DeckError) as info:
        d = deckmod.load(deck, sets)
        preflight.check_inputs(d)
        deckmod.check_world(d, 4)
    msg = str(info.value)
    assert expect in msg, msg
    assert msg.startswith(str(deck)), msg
    assert "\n" not in msg
    # a key a --set gave is named as the command-line option, not as a line of the deck file
    if sets and "=" in sets[0] and "." in sets[0].split("=")[0] and "unknown section" not in msg:
        assert f"--set {sets[0].split('=')[0]}" in msg, msg


# One bad deck of each kind goes through 4 ranks (a TOML error, a key, a file, the world size,
# the layout, a --set): the MPI exit path is the same for all, and every message is checked in
# process above.
MPI_BAD = ("toml syntax", "unknown key", "missing corpus", "ranks per node", "nodes per switch",
           "set bad value", "set inf")


def test_bad_decks_exit_2_on_4_ranks(tmp_path, corpus):
    """Bad decks of every kind end all 4 ranks with exit code 2, within 20 s, the key named
    once."""
    chosen = [b for b in BAD_DECKS if b[0] in MPI_BAD]
    assert len(chosen) == len(MPI_BAD)
    for i, (name, text, sets, expect) in enumerate(chosen):
        sub = tmp_path / f"d{i}"
        sub.mkdir()
        deck = _deck(sub, text, corpus)
        args = ["-m", "semzo", "check", str(deck)]
        for s in sets:
            args += ["--set", s]
        t0 = time.monotonic()
        proc = mpirun(4, args, timeout=20)
        took = time.monotonic() - t0
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
        assert took < 20, (name, took)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1, (name, proc.stderr)
        assert expect in lines[0], (name, lines[0])


def test_check_prints_resolved_deck(tmp_path, corpus):
    deck = _deck(tmp_path, "[cluster]\nk = 5\n", corpus)
    proc = check(mpirun(2, ["-m", "semzo", "check", str(deck), "--set", "run.seed=9"],
                        timeout=30))
    resolved = deckmod.from_toml_text(proc.stdout)
    assert resolved.cluster.k == 5 and resolved.run.seed == 9
    assert proc.stdout.count("[cluster]") == 1  # printed once, by rank 0


def test_docs_deck_md_matches_schema():
    text = (ROOT / "docs" / "deck.md").read_text()
    assert text.strip() == deckdoc.markdown().strip(), \
        "docs/deck.md is stale: run `make docs`"
    for cls in deckmod.SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text


def test_cli_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "semzo", "frobnicate"], capture_output=True, check=False,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_demo_decks_are_valid(tmp_path):
    for deck in sorted((ROOT / "inputs").glob("*.toml")):
        d = deckmod.build(tomllib.loads(deck.read_text()), str(deck),
                          ["run.stages=[\"topology\"]"])
        assert d.run.output_dir
        assert Path(deck).read_text().count("[") >= 1


@pytest.mark.parametrize("config,want", [
    ("{not json", "config.json: cannot read"),
    ('{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}', "t5"),
    (('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10, '
     '"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 3, '
     '"num_key_value_heads": 2, "intermediate_size": 16}'), "num_key_value_heads"),
], ids=["not json", "unsupported architecture", "bad values"])
@pytest.mark.parametrize("stages", ['["embed"]', '["finetune"]'])
def test_model_config_is_read_when_the_deck_is_checked(corpus, tmp_path, config, want,
                                                       stages):
    """model.path's config.json is parsed with the deck (before any stage writes a file):
    not JSON, an architecture semzo does not run or values it refuses give one line naming
    model.path, for the embed stage (which would otherwise have sharded with the packaged
    MiniLM instead) and for the finetune stage alone."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    with pytest.raises(DeckError, match=r"^x.toml: model.path: ") as exc:
        preflight.check_inputs(deckmod.build({"corpus": {"path": str(corpus)}}, "x.toml",
                                             [f"model.path={folder}",
                                              f"run.stages={stages}"]))
    assert want in str(exc.value) and "\n" not in str(exc.value)


def test_keys_the_trainable_set_does_not_read_are_named():
    """A deck file's trainable-set key that the --set train.params on top of it does not read
    (demo.toml's last_layers = 0 under params = lora) is named, for the finetune stage's log,
    not refused (deck and overrides are layered) and not ignored silently; defaults are not."""
    from semzo.deck.read import unread_keys

    demo = str(ROOT / "inputs" / "demo.toml")
    d = deckmod.load(demo, ["train.params=lora"], check_inputs=False)
    assert unread_keys(d) == [(f"{demo}: train.last_layers = 0 is not read: it "
                              "applies to train.params = \"head+last\", and train.params is "
                              "\"lora\"")]
    d = deckmod.load(None, ["train.params=all", "train.lora_rank=4", "train.lora_layers=2"],
                     check_inputs=False)
    assert [m.split(" = ")[0] for m in unread_keys(d)] == ["<defaults>: train.lora_rank",
                                                           "<defaults>: train.lora_layers"]
    assert unread_keys(deckmod.load(None, ["train.lora_rank=8"], check_inputs=False)) == []
    for name in ("demo", "llm", "sft", "choice"):
        assert unread_keys(deckmod.load(ROOT / "inputs" / f"{name}.toml", [],
                                        check_inputs=False)) == [], name

"""The instruction tasks (issue 31): ``sft`` (loss on completion tokens only, chat templates,
truncation, generation metrics) and ``choice`` (log-likelihood scores of each choice) against
transformers, their streamed schedule against the three-pass step, and a learning test each;
the record formats and their errors, and Parquet input against the JSONL of the same records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from llmutil import tiny_llama
from zo_common import SoloTopo

from semzo.corpus import read_corpus_slice
from semzo.corpus.records import check_record
from semzo.finetune.data import Batcher
from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
from semzo.finetune.trainable import select_trainable
from semzo.model import load_model
from semzo.model.chat import InstructTokenizer, render_chat
from semzo.runtime import SemzoError
from semzo.tasks.choice import ChoiceTask
from semzo.tasks.sft import SFTTask, exact_match, token_f1
from semzo.zo.engine import ZOEngine
from semzo.zo.perturb import ztensors
from semzo.zo.streamed import step_streamed

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "models" / "smollm2-135m-instruct"
NOUNS = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green"]
TPL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("sft") / "llama", chat_template=TPL)


def sentiment(n: int, seed: int = 0):
    """(text, label): four nouns and one sentiment word (label 0: good/great, 1: bad/awful)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lab = int(rng.integers(2))
        ws = [str(w) for w in rng.choice(NOUNS, 4)]
        ws.append(str(rng.choice(["good", "great"] if lab == 0 else ["bad", "awful"])))
        rng.shuffle(ws)
        out.append((" ".join(ws), lab))
    return out


def _sft(folder, recs, max_len=40, model=None, n_train=None, **kw):
    it = InstructTokenizer.from_folder(folder)
    enc = [it.sft(r, max_len) for r in recs]
    m = model or load_model(folder)
    n = len(recs)
    n_train = n_train or n
    held = np.arange(n_train, n) if n_train < n else np.arange(n)
    return m, SFTTask(m, [e[0] for e in enc], [e[1] for e in enc], np.arange(n_train), held,
                      it.pad_id, 64, tk=it.tk, eos={it.eos_id}, **kw)


def _choice(folder, recs, max_len=40, model=None, n_train=None, mean=False):
    it = InstructTokenizer.from_folder(folder)
    cc = [it.choice(r, max_len) for r in recs]
    m = model or load_model(folder)
    n = len(recs)
    n_train = n_train or n
    held = np.arange(n_train, n) if n_train < n else np.arange(n)
    return m, ChoiceTask(m, [c[0] for c in cc], [c[1] for c in cc], [r["answer"] for r in recs],
                         np.arange(n_train), held, it.pad_id, 64, mean=mean)


SFT_RECS = [
    {"prompt": "the cat is", "completion": " good"},
    {"prompt": "red blue green tree sun", "completion": " bad awful"},
    {"messages": [{"role": "system", "content": "be kind"},
                  {"role": "user", "content": "cat dog"},
                  {"role": "assistant", "content": "good"},
                  {"role": "user", "content": "sun"},
                  {"role": "assistant", "content": "moon tree"}]},
]


# ----------------------------------------------------------------------------- sft
def test_sft_loss_equals_transformers_with_prompt_labels_masked(llama):
    """The hand (semzo) loss of a batch of prompt/completion and chat records equals
    transformers' loss with labels -100 on every prompt and template token (a mean per
    completion token over the batch); the streamed stages give the same bits."""
    from transformers import AutoModelForCausalLM
    _, task = _sft(llama, SFT_RECS)
    b = task.batch(np.arange(3))
    ours = task.loss(b)
    hf = AutoModelForCausalLM.from_pretrained(llama).eval()
    ids = torch.tensor(b[0])
    labels = ids.clone()
    labels[torch.tensor(b[4]) == 0] = -100
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=torch.tensor(b[1]).long(), labels=labels).loss
    assert ours == pytest.approx(float(ref), rel=1e-5)
    st = task.stage_begin(b)
    for k in range(task.stage_count()):
        st = task.stage_run(k, st)
    assert task.loss_from_state(st, b) == ours
    # the loss tokens: the completion and the end token; each assistant turn
    it = InstructTokenizer.from_folder(llama)
    ids0, loss0, cut = it.sft(SFT_RECS[0], 40)
    assert ids0[-1] == it.eos_id and cut == 0
    assert int(np.argmax(loss0)) == len(it.tk.encode("the cat is").ids)
    assert it.tk.decode(ids0[loss0].tolist()) == " good"
    ids2, loss2, _ = it.sft(SFT_RECS[2], 80)
    assert it.tk.decode(ids2[loss2].tolist()) == "goodmoon tree"


def test_sft_prefix_cache_equals_full_forward(llama):
    recs = [{"prompt": t, "completion": [" good", " bad"][y]} for t, y in sentiment(10)]
    _, plain = _sft(llama, recs)
    _, cached = _sft(llama, recs, layer=1)
    assert cached.stage_count() == plain.stage_count() - 2 and not cached.tied_head
    b = plain.batch(np.arange(10))
    assert cached.loss(b) == pytest.approx(plain.loss(b), rel=1e-6)
    np.testing.assert_allclose(cached.eval_sums(), plain.eval_sums(), rtol=1e-6)


def test_sft_truncation_keeps_the_completion(llama):
    it = InstructTokenizer.from_folder(llama)
    rec = {"prompt": " ".join(NOUNS * 3), "completion": " good bad"}
    full, fl, _ = it.sft(rec, 200)
    ids, loss, cut = it.sft(rec, 10)
    assert len(ids) == 10 and cut == len(full) - 10
    assert (ids == full[-10:]).all() and loss.sum() == fl.sum()
    assert it.sft(rec, int(fl.sum())) is None           # no prompt token left: overlong


def test_chat_rendering_equals_transformers_on_smollm2():
    """SmolLM2-135M-Instruct's own template: the sandboxed renderer gives transformers'
    apply_chat_template text (with and without a system turn, with and without the
    generation prompt), the tokens are transformers' and the loss tokens are exactly each
    assistant content with its <|im_end|> and newline."""
    if not (SMOL / "tokenizer_config.json").is_file():
        pytest.skip("models/smollm2-135m-instruct not converted (make setup)")
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(SMOL))
    tc = json.loads((SMOL / "tokenizer_config.json").read_text())
    msgs = SFT_RECS[2]["messages"]
    for gen in (False, True):
        for part in (msgs, msgs[1:], msgs[1:2]):
            assert render_chat(tc, part, gen) == hf.apply_chat_template(
                part, tokenize=False, add_generation_prompt=gen)
    it = InstructTokenizer.from_folder(SMOL)
    ids, loss, _ = it.sft({"messages": msgs}, 512)
    want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert ids.tolist() == list(want)
    assert it.tk.decode(ids[loss].tolist(), skip_special_tokens=False) == \
        "good<|im_end|>\nmoon tree<|im_end|>\n"


def test_squad_metrics():
    assert exact_match("The Cat!", "cat") == 1.0 and exact_match("a dog", "cat") == 0.0
    assert token_f1("red blue cat", "blue cat dog") == pytest.approx(2 / 3)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0


def test_sft_generation_metrics(llama):
    """Greedy generations of the fixed held-out subset are scored (exact match, F1) and kept
    as examples (prompt, reference, generation)."""
    _, task = _sft(llama, SFT_RECS, gen_rows=[0, 1], gen_tokens=4, topo=SoloTopo())
    task.eval_sums()
    em, f1, n = task.last_gen
    assert n == 2 and 0 <= em <= f1 <= 1
    assert [e[1] for e in task.examples] == ["good", "bad awful"]
    assert all(len(e[2].split()) <= 4 for e in task.examples)


def test_sft_validation_split(llama):
    """train.val_fraction: the validation rows leave the held-out batches and the generation
    subset; evaluating the validation split sums exactly its rows and generates nothing, and
    the two splits' sums add up to the evaluation of all the rows."""
    from semzo.finetune.loop import evaluate

    _, whole = _sft(llama, SFT_RECS)
    total = whole.eval_sums()
    _, task = _sft(llama, SFT_RECS, gen_rows=[0, 1], gen_tokens=4, topo=SoloTopo())
    is_val = np.zeros(len(SFT_RECS), bool)
    is_val[1] = True
    task.split_eval(is_val)
    assert task.gen_rows.tolist() == [0]
    assert sorted(int(r) for b in task.val_batches for r in b) == [1]
    assert 1 not in [int(r) for b in task.eval_batches for r in b]
    task.last_gen = None
    val = evaluate(task, SoloTopo(), split="val")
    assert task.last_gen is None                                 # no generation on it
    test = evaluate(task, SoloTopo())
    assert task.last_gen is not None and task.last_gen[2] == 1
    assert val[2] + test[2] == total[2] > 0 and val[2] > 0
    assert val[0] * val[2] + test[0] * test[2] == pytest.approx(total[0], rel=1e-5)


# ----------------------------------------------------------------------------- choice
def test_choice_scores_equal_transformers_log_likelihoods(llama):
    """Each choice's summed (and mean) log-likelihood after the prompt, for records of 2 and 3
    choices of different token lengths in one batch, equals transformers' log-softmax sums;
    loss and accuracy are the softmax over each record's choices."""
    from transformers import AutoModelForCausalLM
    recs = [{"prompt": "the cat is", "choices": [" good", " bad awful", " red"], "answer": 0},
            {"prompt": "sun moon", "choices": [" tree", " green blue sun"], "answer": 1}]
    _, task = _choice(llama, recs)
    b = task.batch(np.arange(2))
    ours = task.choice_scores(task._full(b).hidden, b)
    hf = AutoModelForCausalLM.from_pretrained(llama).eval()
    it = InstructTokenizer.from_folder(llama)
    want, lens = [], []
    with torch.no_grad():
        for r in recs:
            p, cs = it.choice(r, 40)[:2]
            for c in cs:
                lp = torch.log_softmax(hf(torch.tensor([np.concatenate([p, c]).tolist()]))
                                       .logits[0].double(), -1)
                want.append(sum(float(lp[len(p) + j - 1, int(c[j])]) for j in range(len(c))))
                lens.append(len(c))
    np.testing.assert_allclose(ours, want, rtol=1e-5)
    z = [np.array(want[:3]), np.array(want[3:])]
    ce = np.mean([np.logaddexp.reduce(s) - s[r["answer"]] for s, r in zip(z, recs)])
    acc = np.mean([np.argmax(s) == r["answer"] for s, r in zip(z, recs)])
    loss, got_acc = task.eval_batch(np.arange(2))
    assert loss == pytest.approx(ce, rel=1e-5) and got_acc == acc
    _, mean_task = _choice(llama, recs, mean=True)
    np.testing.assert_allclose(mean_task.choice_scores(task._full(b).hidden, b),
                               np.array(want) / np.array(lens), rtol=1e-5)


@pytest.mark.parametrize("kind,layer", [("sft", 0), ("sft", 1), ("choice", 0)],
                         ids=["sft", "sft-prefix-cache", "choice"])
def test_streamed_equals_three_pass(llama, kind, layer):
    """The default streamed schedule gives the three-pass step's bits (LoRA, tied head; for
    sft also LoRA in the top block over the frozen-prefix cache)."""
    data = sentiment(12, seed=3)

    def run(schedule):
        m = load_model(llama)
        names = select_trainable(m, "lora", lora_rank=4, lora_alpha=8,
                                 lora_layers=1 if layer else 0)
        if kind == "sft":
            _, task = _sft(llama, [{"prompt": t, "completion": [" good", " bad"][y]}
                                   for t, y in data], model=m, layer=layer)
            assert (task.cache is not None) == (layer > 0)
        else:
            _, task = _choice(llama, [{"prompt": t, "choices": [" good", " bad no"],
                                       "answer": y} for t, y in data], model=m)
        eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                       run_seed=4, schedule=schedule)
        out = []
        for s in range(2):
            b = task.batch(np.arange(6 * s, 6 * s + 6))
            r = (step_streamed(eng, task, b, s, 1e-2, 6) if schedule == "streamed"
                 else eng.step(lambda b=b: task.loss(b), s, 1e-2, 6))
            out.append((r.lp, r.lm, r.g))
        eng.flush()
        return out, {n: np.array(m.params[n]) for n in names}

    a, pa = run("streamed")
    b, pb = run("three-pass")
    assert a == b
    assert all((pa[n] == pb[n]).all() for n in pa)


# ----------------------------------------------------------------------------- learning
def _learn(folder, kind: str, seed: int):
    data = sentiment(300)
    m = load_model(folder)
    if kind == "sft":       # calibrated: head+last:1, lr 0.05, 600 steps
        names = select_trainable(m, "head+last", last_layers=1)
        _, task = _sft(folder, [{"prompt": t + " It was", "completion": [" good", " bad"][y]}
                                for t, y in data], model=m, n_train=200)
        lr, steps = 0.05, 600
    else:                   # calibrated: LoRA q,v, lr 0.05, 800 steps
        names = select_trainable(m, "lora", lora_rank=4, lora_alpha=8, seed=seed)
        _, task = _choice(folder, [{"prompt": t + " It was", "choices": [" good", " bad"],
                                    "answer": y} for t, y in data], model=m, n_train=200)
        lr, steps = 0.05, 800
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   run_seed=seed)
    before = evaluate(task, SoloTopo())
    train(eng, task, Batcher(200, 16, seed, 0), TrainState(run_seed=seed),
          LoopConfig(steps=steps, lr=lr, eval_every=0, log_every=10**6, checksum_every=0))
    return before, evaluate(task, SoloTopo())


def test_sft_learns(llama):
    """Completion loss of " good"/" bad" after a synthetic sentiment text, 3 seeds. Measured
    when written: 5.968 -> 5.688, 5.685, 5.720 (drops 0.280, 0.283, 0.248: sd 0.019). Each
    seed must fall by 0.15 (7 sd) and the spread stay below half the mean fall."""
    runs = [_learn(llama, "sft", s) for s in range(3)]
    start = runs[0][0][0]
    drops = np.array([start - r[1][0] for r in runs])
    assert drops.min() > 0.15, drops
    assert drops.max() - drops.min() < drops.mean() / 2, drops


def test_choice_learns(llama):
    """The same texts as two-choice records, LoRA q,v, 3 seeds. Measured when written: loss
    0.691 -> 0.630, 0.588, 0.583 (drops 0.061, 0.103, 0.108: sd 0.026), accuracy 0.52 ->
    0.70, 0.79, 0.78. Each seed must fall by 0.03, the mean by 0.06, accuracy reach 0.62."""
    runs = [_learn(llama, "choice", s) for s in range(3)]
    start = runs[0][0][0]
    drops = np.array([start - r[1][0] for r in runs])
    assert drops.min() > 0.03 and drops.mean() > 0.06, drops
    assert min(r[1][1] for r in runs) > 0.62, [r[1][1] for r in runs]


# ----------------------------------------------------------------------------- records
@pytest.mark.parametrize("kind,obj,want", [
    ("sft", {"prompt": "p"}, "missing 'completion'"),
    ("sft", {"prompt": "p", "completion": "  "}, "'completion' is empty"),
    ("sft", {"completion": "c"}, "missing 'prompt'"),
    ("sft", {"text": "x"}, "missing 'messages' (or 'prompt' and 'completion')"),
    ("sft", {"messages": [{"role": "bot", "content": "x"}]}, "'role' must be one of"),
    ("sft", {"messages": [{"role": "user", "content": 3}]}, "must be a string, got integer"),
    ("sft", {"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ("sft", {"messages": []}, "non-empty array"),
    ("choice", {"prompt": "p", "choices": ["a", "b"], "answer": 2}, "out of range"),
    ("choice", {"prompt": "p", "choices": ["a", "b"]}, "missing 'answer'"),
    ("choice", {"prompt": "p", "choices": ["a"], "answer": 0}, "2 to 16"),
    ("choice", {"prompt": "p", "choices": ["a", 5], "answer": 0}, "choices[1] must be a str"),
    ("choice", {"prompt": "p", "choices": ["a", "b"], "answer": True}, "must be an integer"),
])
def test_malformed_records(kind, obj, want):
    got = check_record(obj, kind)
    assert isinstance(got, str) and want in got, got


def _records(n: int) -> list[dict]:
    out = []
    for i, (t, y) in enumerate(sentiment(n, seed=7)):
        if i % 3 == 2:
            out.append({"messages": [{"role": "user", "content": t},
                                     {"role": "assistant", "content": ["good", "bad"][y]}]})
        else:
            out.append({"prompt": t, "completion": [" good", " bad"][y]})
    return out


def _write_parquet(path: Path, recs: list[dict], group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": r.get("prompt"), "completion": r.get("completion"),
             "messages": r.get("messages")} for r in recs]
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=group)


def test_parquet_equals_jsonl(tmp_path):
    """The same sft records as JSONL and as Parquet (several row groups, mixed prompt/
    completion and messages rows, nulls where a column does not apply) read to the same
    stored records, embedded texts and ids; a malformed row names the file and the row."""
    pytest.importorskip("pyarrow")
    recs = _records(25)
    jl = tmp_path / "c.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    pq_path = tmp_path / "c.parquet"
    _write_parquet(pq_path, recs, 7)
    a = read_corpus_slice(jl, MPI.COMM_SELF, "sft")
    b = read_corpus_slice(pq_path, MPI.COMM_SELF, "sft")
    assert a.texts == b.texts and a.embed == b.embed and (a.ids == b.ids).all()
    assert a.labels is None and b.labels is None
    bad = [*recs[:9], {"prompt": "x", "completion": ""}, *recs[9:]]
    _write_parquet(tmp_path / "bad.parquet", bad, 4)
    with pytest.raises(SemzoError, match=r"bad.parquet: row 9 \(0-based\): 'completion' is "
                                         r"empty"):
        read_corpus_slice(tmp_path / "bad.parquet", MPI.COMM_SELF, "sft")
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(SemzoError, match=r"bad.jsonl:10: 'completion' is empty"):
        read_corpus_slice(tmp_path / "bad.jsonl", MPI.COMM_SELF, "sft")


# ----------------------------------------------------------------------------- bad model files
def _variant(llama: Path, folder: Path, tc: dict | None = None, cfg: dict | None = None) -> Path:
    """The tokenizer files of ``llama`` in ``folder`` with keys of tokenizer_config.json
    (``tc``) and config.json (``cfg``) replaced (no weights: the tokenizer reads none)."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((llama / "tokenizer.json").read_bytes())
    for name, new in (("tokenizer_config.json", tc), ("config.json", cfg)):
        old = json.loads((llama / name).read_text())
        (folder / name).write_text(json.dumps({**old, **(new or {})}))
    return folder


def _ctx(tmp_path):
    return SimpleNamespace(topo=SoloTopo(), path=lambda name: tmp_path / name)


@pytest.mark.parametrize("tpl, want", [
    ("{% if %}", "not a valid jinja2 template"),
    ("{{ 1/0 }}", "cannot render (ZeroDivisionError"),
    ("{% set _ = messages.append(1) %}", "cannot render (SecurityError"),
    ("{{ messages[0].content | nosuchfilter }}", "not a valid jinja2 template"),
    (5, "must be a string, got int"),
    ([7], "must hold {\"name\", \"template\"} objects"),
])
def test_malformed_chat_template_is_one_error(llama, tmp_path, tpl, want):
    folder = _variant(llama, tmp_path / "m", {"chat_template": tpl})
    rec = {"messages": [{"role": "user", "content": "cat"},
                        {"role": "assistant", "content": "good"}]}
    with pytest.raises(SemzoError) as exc:
        InstructTokenizer.from_folder(folder).sft(rec, 40)
    msg = str(exc.value)
    assert msg.startswith(f"{folder}: tokenizer_config.json: chat_template: ") and want in msg, \
        msg
    assert "\n" not in msg
    with pytest.raises(SemzoError, match="tokenizer_config.json: chat_template: "):
        render_chat({"chat_template": tpl}, rec["messages"])


def test_template_failing_on_one_record_stops_every_rank_naming_it(llama, tmp_path):
    """A template that fails on one record only: the error every rank raises together
    (:class:`AllRanksError`) names shards.h5, the record id and the template."""
    from semzo.runtime import AllRanksError
    from semzo.tasks.sft import encode_records
    tpl = TPL.replace("{% for m in messages %}", "{% for m in messages %}{% if m['content'] == "
                      "'boom' %}{{ 1/0 }}{% endif %}")
    folder = _variant(llama, tmp_path / "m", {"chat_template": tpl})
    it = InstructTokenizer.from_folder(folder)
    recs = [dict(r) for r in SFT_RECS] + [
        {"messages": [{"role": "user", "content": "boom"},
                      {"role": "assistant", "content": "good"}]}]
    assert all(e is not None for e in encode_records(_ctx(tmp_path), recs[:3],
                                                     np.arange(3), it.sft, 40))
    with pytest.raises(AllRanksError) as exc:
        encode_records(_ctx(tmp_path), recs, np.array([4, 5, 6, 41]), it.sft, 40)
    msg = str(exc.value)
    assert msg.startswith(f"{tmp_path / 'shards.h5'}: record id 41: {folder}: "
                          f"tokenizer_config.json: chat_template: cannot render "
                          f"(ZeroDivisionError"), msg


def test_preflight_names_the_corpus_line_of_a_record_the_template_refuses(llama, tmp_path):
    from semzo.corpus.records import canonical
    from semzo.preflight import check_record_lengths
    from semzo.runtime import AllRanksError
    tpl = TPL.replace("{% for m in messages %}", "{% for m in messages %}{% if m['content'] == "
                      "'boom' %}{{ 1/0 }}{% endif %}")
    folder = _variant(llama, tmp_path / "m", {"chat_template": tpl})
    deck = SimpleNamespace(train=SimpleNamespace(overlong="error", max_length=40),
                           model=SimpleNamespace(path=str(folder), max_length=40),
                           corpus=SimpleNamespace(path="c.jsonl"))
    ctx = SimpleNamespace(deck=deck, topo=SoloTopo())
    boom = {"messages": [{"role": "user", "content": "boom"},
                         {"role": "assistant", "content": "good"}]}
    records = [(canonical(r), "", line) for line, r in ((1, SFT_RECS[0]), (3, boom))]
    check_record_lengths(ctx, "sft", records[:1])
    with pytest.raises(AllRanksError) as exc:
        check_record_lengths(ctx, "sft", records)
    assert str(exc.value).startswith(f"c.jsonl:3: {folder}: tokenizer_config.json: "
                                     f"chat_template: cannot render (ZeroDivisionError"), exc.value


@pytest.mark.parametrize("eos, want", [
    (99999, "in [0, vocab_size = V), got 99999"),
    (True, "got true"),
    ("2", "got \"2\""),
    (-1, "got -1"),
    ([0, 99999], "got [0, 99999]"),
    (1.0, "got 1.0"),
    ([2, 0], 2),
    (None, 0),                     # absent: tokenizer_config.json's eos_token (id 0)
])
def test_eos_token_id_is_checked_against_the_vocabulary(llama, tmp_path, eos, want):
    folder = _variant(llama, tmp_path / "m", cfg={"eos_token_id": eos})
    if isinstance(want, int):
        assert InstructTokenizer.from_folder(folder).eos_id == want
        return
    v = json.loads((folder / "config.json").read_text())["vocab_size"]
    with pytest.raises(SemzoError) as exc:
        InstructTokenizer.from_folder(folder)
    assert str(exc.value).startswith(f"{folder / 'config.json'}: 'eos_token_id' must be a "
                                     f"token id"), exc.value
    assert want.replace("= V", f"= {v}") in str(exc.value), exc.value


def test_stored_records_are_checked_for_the_task_that_reads_them(tmp_path):
    """Shards placed for the other task (train.task switched between sft and choice with
    run.stages = ["finetune"]), or carrying a crafted answer, stop every rank together with
    one error naming shards.h5, the record id and what is wrong (were KeyError 'choices' /
    'completion', an IndexError or a silently wrong answer with -1)."""
    from semzo.corpus.records import canonical
    from semzo.runtime import AllRanksError
    from semzo.tasks.sft import _load_records
    choice = {"prompt": "p", "choices": ["a", "b"], "answer": 1}
    good = {"sft": [SFT_RECS[0], SFT_RECS[2]], "choice": [choice, choice]}
    cases = [
        ("choice", SFT_RECS[0], "missing 'choices'"),
        ("sft", choice, "missing 'completion'"),
        ("choice", {**choice, "answer": 5}, "'answer' 5 is out of range for 2 choices"),
        ("choice", {**choice, "answer": -1}, "'answer' -1 is out of range"),
        ("choice", {**choice, "choices": ["a", ""]}, "choices[1] is empty"),
        ("sft", "plain text", "not a JSON object"),
        ("sft", [1, 2], "not a JSON object"),
    ]
    ctx = _ctx(tmp_path)
    for kind, bad, want in cases:
        texts = [canonical(r) for r in good[kind]]
        rows = SimpleNamespace(texts=texts, ids=np.array([3, 9]))
        assert _load_records(ctx, rows, kind) == good[kind]
        rows = SimpleNamespace(texts=[texts[0], bad if isinstance(bad, str) else canonical(bad),
                                      texts[1], "{"], ids=np.array([3, 7, 9, 8]))
        with pytest.raises(AllRanksError) as exc:
            _load_records(ctx, rows, kind)
        msg = str(exc.value)
        assert msg.startswith(f"{tmp_path / 'shards.h5'}: record id 7: {want}"), msg
        assert f"not a train.task = {kind} record (2 such records)" in msg, msg


class _StubTk:
    """A tokenizer that gives one id per character, none for the character '~'."""

    def encode(self, text, add_special_tokens=False):
        return SimpleNamespace(ids=[ord(ch) % 50 for ch in text if ch != "~"])


def test_choice_of_no_tokens_is_refused_when_encoded(tmp_path):
    """A choice the tokenizer turns into no tokens used to take the next choice's first token
    score (np.add.reduceat), an IndexError for the last, a division by zero with "mean": it
    is refused when the record is encoded, every rank together, naming the record."""
    from semzo.runtime import AllRanksError
    from semzo.tasks.sft import encode_records
    it = InstructTokenizer(_StubTk(), 0, None, None, "stub-model")
    ok = {"prompt": "p q", "choices": ["ab", "c"], "answer": 0}
    p, cs, cut = it.choice(ok, 40)
    assert [len(c) for c in cs] == [2, 1] and len(p) == 3 and cut == 0
    bad = {"prompt": "p q", "choices": ["ab", "~~"], "answer": 0}
    with pytest.raises(SemzoError, match=r"^stub-model: choices\[1\] '~~' is no token of the "):
        it.choice(bad, 40)
    with pytest.raises(AllRanksError) as exc:
        encode_records(_ctx(tmp_path), [ok, bad, ok], np.array([1, 2, 3]), it.choice, 40)
    assert str(exc.value).startswith(f"{tmp_path / 'shards.h5'}: record id 2: stub-model: "
                                     f"choices[1] '~~' is no token"), exc.value

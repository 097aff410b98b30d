"""Fine-tuning the top blocks of an encoder with the frozen lower blocks' output cached:
the partial forward passes equal the full one bit for bit on the same batch, the cached task
gives the same losses and held-out sums as the plain one up to rounding (also after the
trained blocks change), and the
finetune stage takes the cached path only when it may."""

import json

import numpy as np
import pytest
from mpiutil import ROOT

from semzo.finetune.trainable import first_trained_block as _first_trained_block
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.tasks.base import pad_batch
from semzo.tasks.classify import ClassifyTask, PrefixCachedClassifyTask

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def data():
    tok = Tokenizer.from_folder(max_length=48)
    corpus = ROOT / "data" / "fortunes.jsonl"
    if corpus.is_file():
        texts = [json.loads(ln)["text"] for ln in corpus.open()][:60]
    else:
        texts = (ROOT / "tests" / "data" / "model_sentences.txt").read_text().splitlines()[:60]
    seqs = tok.encode_batch(texts)
    labels = np.arange(len(seqs)) % 4
    return tok, seqs, labels


def test_hidden_at_then_from_equals_full_forward(data):
    tok, seqs, _ = data
    m = load_model()
    ids, mask = pad_batch(seqs[:12], tok.pad_id)
    full = m.hidden_states(ids, mask)
    for layer in range(m.config.num_layers + 1):
        x = m.hidden_at(ids, mask, layer)
        x[mask == 0] = 123.0                      # padding content must not matter
        out = m.hidden_from(x, mask, layer)
        assert np.array_equal(out[mask == 1], full[mask == 1]), layer
    with pytest.raises(ValueError):
        m.hidden_at(ids, mask, m.config.num_layers + 1)


@pytest.mark.parametrize("last", [1, 2])
def test_cached_task_equals_plain_task(data, last):
    tok, seqs, labels = data
    m = load_model()
    m.add_classifier(4, seed=0, normalize=True)

    class T:
        params, last_layers, prefix_cache_mb = "head+last", last, 64.0

    names = select_trainable(m, "head+last", last)
    first = _first_trained_block(m, names, T, "classify")
    assert first == m.config.num_layers - last
    train, held = np.arange(0, 48), np.arange(48, 60)
    plain = ClassifyTask(m, seqs, labels, train, held, tok.pad_id, 16)
    cached = PrefixCachedClassifyTask(m, seqs, labels, train, held, tok.pad_id, 16, first)
    pos = np.array([3, 17, 5, 40, 22, 9])
    # the cache was computed in other batches (other padding lengths): rounding only
    assert cached.loss(cached.batch(pos)) == pytest.approx(plain.loss(plain.batch(pos)),
                                                          rel=1e-6)
    assert np.allclose(cached.eval_sums(), plain.eval_sums(), rtol=1e-6)
    # the trained blocks change (as in a ZO step): the cache stays valid
    rng = np.random.default_rng(1)
    for n in names:
        m.params[n] += (0.01 * rng.standard_normal(m.params[n].shape)).astype(np.float32)
    assert cached.loss(cached.batch(pos)) == pytest.approx(plain.loss(plain.batch(pos)),
                                                          rel=1e-6)
    assert np.allclose(cached.eval_sums(), plain.eval_sums(), rtol=1e-6)
    assert cached.cache.shape == (sum(len(q) for q in seqs), m.config.hidden_size)


def test_no_cache_when_lower_layers_train(data):
    m = load_model()
    m.add_classifier(4, seed=0, normalize=True)

    class T:
        params, last_layers, prefix_cache_mb = "head+last", 1, 64.0

    names = [n for n, _ in m.named_parameters()]      # everything trains
    assert _first_trained_block(m, names, T, "classify") == 0
    T.params = "all"
    assert _first_trained_block(m, names, T, "classify") == 0
    T.params, T.prefix_cache_mb = "head+last", 0.0
    names = select_trainable(m, "head+last", 1)
    assert _first_trained_block(m, names, T, "classify") == 0
    T.prefix_cache_mb = 64.0
    assert _first_trained_block(m, names, T, "lm") == 0
    assert _first_trained_block(m, names, T, "classify") == m.config.num_layers - 1

"""Verification inputs for string inputs that are item ids, not text.

A recommender commonly feeds `[batch, K]` strings (item ids, padded with b"" as
tf.data's padded_batch pads them) to a StringLookup or a StaticHashTable. The
export drew raw text for every string input: cells of 1-6 space-joined words,
each one unknown key, so 2-8% of the looked-up ids came from the vocabulary,
no padding was ever generated, and the vocabulary held the model's checkpoint
keys ('.../.ATTRIBUTES/VARIABLE_VALUE'). Inputs that reach a lookup or hash op
without a tokenizer now get one word per cell and trailing padding."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import feeds as F
from pkm_serve.export import main
from pkm_serve.export import verify as V
from pkm_serve.export.saved_model_io import read_saved_model
import export_models

ops.load_library()
VOCAB = [f"movie_{i}" for i in range(40)]
K = 5


def _export(model, path):
    model.export(str(path), verbose=False)
    return str(path)


@pytest.fixture(scope="module")
def history_model(tmp_path_factory):
    """StringLookup(mask_token="") -> Embedding(mask_zero=True) -> masked mean."""
    inp = keras.Input((K,), dtype="string", name="history")
    ids = keras.layers.StringLookup(vocabulary=VOCAB, mask_token="")(inp)
    embedding = keras.layers.Embedding(len(VOCAB) + 2, 4, mask_zero=True)
    out = keras.layers.GlobalAveragePooling1D()(embedding(ids))
    model = keras.Model(inp, out)
    return _export(model, tmp_path_factory.mktemp("history") / "sm"), embedding


def _history_feed(src):
    feeds = F.signature_feeds(read_saved_model(src), "serve")
    return feeds["history"]


def test_id_strings_are_drawn_as_single_known_words_with_padding(history_model):
    src, _ = history_model
    feed = _history_feed(src)
    assert feed.tokens and feed.features is None
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures["serve"])
    cells = V.generate_inputs(specs, index_limit=40, batch_size=8, feeds={"history": feed})["history"]
    assert cells.shape == (8, K)
    words = [c for c in cells.ravel() if c != b""]
    known = sum(w.decode() in VOCAB for w in words)
    assert known >= 0.6 * len(words) and known >= 10, cells
    assert all(b" " not in w for w in words), cells
    padded = cells == b""
    assert padded.any(), cells
    # padding only trails, as padded_batch writes it; the middle row is an empty bag
    assert all(np.array_equal(row, np.sort(row)) for row in padded), cells
    assert padded[4].all() and not padded[0].all()


def test_vocabulary_is_the_lookup_words_not_checkpoint_keys(history_model):
    src, _ = history_model
    assert sorted(w.decode() for w in _history_feed(src).vocabulary) == sorted(VOCAB)


def test_exported_history_model_on_its_warmup_ids_equals_numpy(history_model, tmp_path):
    src, embedding = history_model
    dst = tmp_path / "models"
    assert main([src, str(dst), "--warmup-requests", "1", "--signatures", "serve", "--quiet"]) == 0
    request = export_models.warmup_request(dst)
    cells = tf.make_ndarray(request.inputs["history"])
    fused = tf.saved_model.load(str(dst / "1")).signatures["serve"](history=tf.constant(cells))
    [got] = fused.values()
    table = embedding.embeddings.numpy().astype(np.float64)
    index = {w: i + 2 for i, w in enumerate(VOCAB)}  # 0: mask "", 1: out of vocabulary
    ids = np.array([[0 if c == b"" else index.get(c.decode(), 1) for c in row] for row in cells])
    mask = ids > 0
    assert (ids >= 2).sum() >= 0.4 * ids.size
    with np.errstate(invalid="ignore"):
        want = (table[ids] * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_text_inputs_stay_text(tmp_path):
    inp = keras.Input((1,), dtype="string", name="text")
    ids = keras.layers.TextVectorization(vocabulary=VOCAB, output_sequence_length=6)(inp)
    out = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(len(VOCAB) + 2, 4)(ids))
    src = _export(keras.Model(inp, out), tmp_path / "text")
    feed = F.signature_feeds(read_saved_model(src), "serve")["text"]
    assert not feed.tokens
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures["serve"])
    cells = V.generate_inputs(specs, index_limit=40, batch_size=16, feeds={"text": feed})["text"]
    assert any(b" " in c for c in cells.ravel()), cells


def test_ids_of_a_vocabulary_file_are_its_words(tmp_path):
    """StringLookup(vocabulary=PATH) keeps its words in an asset file, no string constant: every id
    generated was out of vocabulary, each bag of the warmup read the one OOV row."""
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    inp = keras.Input((K,), dtype="string", name="history")
    ids = keras.layers.StringLookup(vocabulary=str(path), mask_token="")(inp)
    out = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(len(VOCAB) + 2, 4, mask_zero=True)(ids))
    src = _export(keras.Model(inp, out), tmp_path / "sm")
    dst = tmp_path / "models"
    assert main([src, str(dst), "--warmup-requests", "1", "--signatures", "serve", "--quiet"]) == 0
    request = export_models.warmup_request(dst)
    words = [c.decode() for c in tf.make_ndarray(request.inputs["history"]).ravel() if c]
    assert np.isin(words, VOCAB).mean() >= 0.6, words


def test_text_of_a_vocabulary_file_is_made_of_its_words(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    inp = keras.Input((1,), dtype="string", name="text")
    ids = keras.layers.TextVectorization(vocabulary=str(path), output_sequence_length=6)(inp)
    src = _export(keras.Model(inp, keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(ids))),
                  tmp_path / "sm")
    feed = F.signature_feeds(read_saved_model(src), "serve", os.path.join(src, "assets"))["text"]
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures["serve"])
    cells = V.generate_inputs(specs, index_limit=40, batch_size=16, feeds={"text": feed})["text"]
    words = [w.decode() for c in cells.ravel() for w in c.split()]
    assert not feed.tokens and np.isin(words, VOCAB).mean() >= 0.6, cells

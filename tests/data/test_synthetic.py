"""Synthetic tasks: MQAR answers by naive lookup, passkey prompts and exact-match accuracy."""

from __future__ import annotations

import re

import numpy as np
import pytest

from k3jax.config import DataConfig
from k3jax.data.corpus import load_corpus
from k3jax.data.synthetic import mqar_batch, passkey_accuracy, passkey_batch
from k3jax.data.tokenizers import ByteTokenizer


def _check_dtypes(batch, shape):
  for k, dtype in (("inputs", np.int32), ("targets", np.int32), ("segment_ids", np.int32),
                   ("loss_mask", np.float32)):
    assert batch[k].shape == shape and batch[k].dtype == dtype, k
  assert (batch["segment_ids"] == 1).all()


@pytest.mark.parametrize("seq_len,vocab,k", [(64, 64, 8), (24, 17, 8), (256, 8192, 32)])
def test_mqar_answers_by_naive_lookup(seq_len, vocab, k):
  batch = mqar_batch(np.random.default_rng(0), 16, seq_len, vocab, k)
  _check_dtypes(batch, (16, seq_len))
  assert batch["inputs"].min() >= 0 and batch["inputs"].max() < vocab
  for x, y, m in zip(batch["inputs"], batch["targets"], batch["loss_mask"]):
    table = {}
    for t in range(0, 2 * k, 2):
      assert x[t] not in table   # keys are distinct within a row
      table[x[t]] = x[t + 1]
    answered = []
    for t in range(seq_len):
      if m[t]:
        assert t >= 2 * k and y[t] == table[x[t]]
        answered.append(x[t])
      else:
        assert y[t] == 0
    assert sorted(answered) == sorted(table)   # every key queried exactly once
    assert set(x[2 * k:][m[2 * k:] == 0]) <= {0}   # the rest is filler
  again = mqar_batch(np.random.default_rng(0), 16, seq_len, vocab, k)
  np.testing.assert_array_equal(again["inputs"], batch["inputs"])


def test_mqar_errors():
  with pytest.raises(ValueError, match="seq_len=20 must be at least 3 \\* num_kv_pairs = 24"):
    mqar_batch(0, 2, 20, 64, 8)
  with pytest.raises(ValueError, match="num_kv_pairs=8 needs vocab_size >= 17"):
    mqar_batch(0, 2, 64, 16, 8)


def _answer(batch, row):
  m = batch["loss_mask"][row] > 0
  return ByteTokenizer().decode(batch["targets"][row][m])


@pytest.mark.parametrize("seq_len", [128, 1000, 4096])
def test_passkey_answer_is_in_the_prompt(seq_len):
  batch = passkey_batch(np.random.default_rng(1), 8, seq_len, digits=5)
  _check_dtypes(batch, (8, seq_len))
  tok = ByteTokenizer()
  depths = []
  for row in range(8):
    answer = _answer(batch, row)
    assert re.fullmatch(r"[1-9]\d{4}", answer)
    m = batch["loss_mask"][row] > 0
    assert m[-5:].all() and m.sum() == 5
    prompt = tok.decode(batch["inputs"][row][:seq_len - 4])   # up to the answer's first digit
    assert batch["inputs"][row][0] == tok.bos_id
    assert prompt.endswith("What is the pass key? The pass key is ")
    hidden = re.findall(r"The pass key is (\d+)\. Remember it\.", prompt)
    assert hidden == [answer]
    depths.append(prompt.index("The pass key is " + answer) / seq_len)
    np.testing.assert_array_equal(batch["inputs"][row][1:], batch["targets"][row][:-1])
  if seq_len >= 1000:
    assert max(depths) - min(depths) > 0.2   # random depths


def test_passkey_depth_filler_and_errors():
  tok = ByteTokenizer()
  first = passkey_batch(0, 2, 512, depth=0.0)
  last = passkey_batch(0, 2, 512, depth=1.0)
  assert tok.decode(first["inputs"][0][1:18]) == " The pass key is "
  assert "Remember it." in tok.decode(last["inputs"][0][-150:])
  corpus = load_corpus(DataConfig(max_bytes=200_000))
  batch = passkey_batch(3, 4, 2048, filler_tokens=corpus.valid_tokens, digits=7)
  for row in range(4):
    text = tok.decode(batch["inputs"][row])
    assert re.search(r"The pass key is %s\." % _answer(batch, row), text)
    assert (batch["inputs"][row][1:] != tok.bos_id).all()
    assert "The grass is green" not in text
  with pytest.raises(ValueError, match="seq_len=50 is too short"):
    passkey_batch(0, 1, 50)
  with pytest.raises(ValueError, match="depth=1.5"):
    passkey_batch(0, 1, 512, depth=1.5)


def test_passkey_accuracy_is_exact_match_of_answer():
  batch = passkey_batch(0, 4, 256)
  v = 257
  logits = np.eye(v, dtype=np.float32)[batch["targets"]]   # perfect predictions
  np.testing.assert_array_equal(passkey_accuracy(logits, batch), [True] * 4)
  wrong = logits.copy()
  wrong[1, -3] = np.roll(wrong[1, -3], 1)      # one answer digit wrong in row 1
  wrong[2, 10] = np.roll(wrong[2, 10], 1)      # a filler position wrong in row 2: does not count
  np.testing.assert_array_equal(passkey_accuracy(wrong, batch), [True, False, True, True])
  with pytest.raises(ValueError, match="logits have shape"):
    passkey_accuracy(logits[:, :10], batch)

"""Packing by global step: windows, segment ids, loss mask, cyclic epochs, grain iterator."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from k3jax.config import DataConfig, StagesConfig
from k3jax.data import corpus as corpus_lib
from k3jax.data.corpus import iter_documents, load_corpus
from k3jax.data.packing import (StageSeqLen, TokenWindows, check_validation_size, make_batch,
                                make_train_iterator, train_source, validation_batches)

BOS = 256


@pytest.fixture(scope="module")
def builtin():
  return load_corpus(DataConfig(max_bytes=1_000_000))


def _naive_row(inputs, targets):
  """Segment ids and loss mask of one row by a plain loop."""
  seg, mask, current = [], [], 1
  for t, (x, y) in enumerate(zip(inputs, targets)):
    if t > 0 and x == BOS:
      current += 1
    seg.append(current)
    mask.append(0.0 if y == BOS else 1.0)
  return seg, mask


def _check_batch(batch, seq_len):
  assert batch["inputs"].shape == (batch["inputs"].shape[0], seq_len)
  assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
  assert batch["segment_ids"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
  for x, y, s, m in zip(batch["inputs"], batch["targets"], batch["segment_ids"],
                        batch["loss_mask"]):
    seg, mask = _naive_row(x, y)
    np.testing.assert_array_equal(s, seg)
    np.testing.assert_array_equal(m, mask)
    np.testing.assert_array_equal(x[1:], y[:-1])   # targets are the next tokens


def test_make_batch_small_stream():
  #              d1----  d2-  d3-------
  window = np.array([BOS, 5, 6, BOS, 7, BOS, 8, 9, 10], np.int32)
  b = make_batch(window, 4, BOS)
  np.testing.assert_array_equal(b["inputs"], [[BOS, 5, 6, BOS], [7, BOS, 8, 9]])
  np.testing.assert_array_equal(b["targets"], [[5, 6, BOS, 7], [BOS, 8, 9, 10]])
  np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2], [1, 2, 2, 2]])
  np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 0, 1], [0, 1, 1, 1]])
  with pytest.raises(ValueError, match="seq_len=3"):
    make_batch(window, 3, BOS)


def test_step_windows_are_independent_of_seq_len(builtin):
  p = 4096
  windows = TokenWindows(builtin.train_tokens, BOS, p, seed=builtin.seed)
  for step in (0, 1, 7, 100):
    a, b, c = windows.batch(step, 64), windows.batch(step, 512), windows.batch(step, p)
    assert a["inputs"].shape == (64, 64) and b["inputs"].shape == (8, 512)
    for other in (b, c):
      np.testing.assert_array_equal(a["inputs"].reshape(-1), other["inputs"].reshape(-1))
      np.testing.assert_array_equal(a["targets"].reshape(-1), other["targets"].reshape(-1))
    stream = builtin.train_tokens
    np.testing.assert_array_equal(a["inputs"].reshape(-1), stream[step * p:(step + 1) * p])
    np.testing.assert_array_equal(a["targets"].reshape(-1), stream[step * p + 1:(step + 1) * p + 1])
    _check_batch(a, 64)
    _check_batch(b, 512)


def test_segment_ids_and_loss_mask_on_corpus_batches(builtin):
  windows = TokenWindows(builtin.train_tokens, BOS, 8192, seed=0)
  # Short rows cross many document boundaries; find steps that do.
  crossings = 0
  for step in range(0, 400, 37):
    b = windows.batch(step, 128)
    _check_batch(b, 128)
    is_bos = b["inputs"] == BOS
    np.testing.assert_array_equal(np.diff(b["segment_ids"], axis=1) == 1, is_bos[:, 1:])
    assert (np.diff(b["segment_ids"], axis=1) >= 0).all()
    np.testing.assert_array_equal(b["loss_mask"] == 0, b["targets"] == BOS)
    crossings += int(is_bos.sum())
  assert crossings > 0


def _stream_docs(tokens):
  return collections.Counter(tuple(d) for d in iter_documents(tokens, BOS))


def test_cyclic_wrap_and_epoch_reshuffle():
  rng = np.random.default_rng(0)
  docs = [("d%d" % i, rng.integers(0, 256, rng.integers(3, 40)).astype(np.int32))
          for i in range(50)]
  stream = corpus_lib.pack_documents(docs, BOS)
  n = stream.size
  p = 64
  repeat = TokenWindows(stream, BOS, p, reshuffle_each_epoch=False)
  step = n // p   # this step's window crosses the end of the stream
  expected = np.concatenate([stream, stream])[step * p:step * p + p + 1]
  np.testing.assert_array_equal(repeat.window(step), expected)
  np.testing.assert_array_equal(repeat.take(3 * n + 5, 10), stream[5:15])

  shuffled = TokenWindows(stream, BOS, p, seed=3)
  epoch1, epoch2 = shuffled.take(n, n), shuffled.take(2 * n, n)
  assert epoch1[0] == BOS and _stream_docs(epoch1) == _stream_docs(stream)
  assert _stream_docs(epoch2) == _stream_docs(stream)
  assert not np.array_equal(epoch1, stream) and not np.array_equal(epoch1, epoch2)
  # Windows read the same epoch streams, across the boundary and deterministically.
  joined = np.concatenate([stream, epoch1, epoch2])
  for s in (step, step + 1, 2 * n // p, 3 * n // p - 1):
    np.testing.assert_array_equal(shuffled.window(s), joined[s * p:s * p + p + 1])
  again = TokenWindows(stream, BOS, p, seed=3)
  np.testing.assert_array_equal(again.take(n + 17, 2 * n), shuffled.take(n + 17, 2 * n))
  assert shuffled.steps_per_epoch == n / p


def test_stream_too_short_and_bad_seq_len():
  stream = corpus_lib.pack_documents([("a", np.arange(50, dtype=np.int32))], BOS)
  with pytest.raises(ValueError, match=r"train split has 51 tokens, fewer than one step needs "
                     r"\(StagesConfig.tokens_per_step = 64, plus one lookahead token\)"):
    TokenWindows(stream, BOS, 64)
  windows = TokenWindows(stream, BOS, 50)
  with pytest.raises(ValueError, match="seq_len=3 must divide StagesConfig.tokens_per_step=50"):
    windows.batch(0, 3)
  with pytest.raises(ValueError, match="stream must start with BOS"):
    TokenWindows(stream[1:], BOS, 8)


def test_train_iterator_follows_stages_and_resumes(builtin):
  stages = StagesConfig(stages=((32, 3), (128, 2), (512, 2)), tokens_per_step=1024)
  seq_len_fn = StageSeqLen(stages)
  cfg = DataConfig(max_bytes=1_000_000)
  windows = TokenWindows(builtin.train_tokens, BOS, 1024, seed=builtin.seed)
  it = make_train_iterator(cfg, 1024, seq_len_fn, corpus=builtin, num_steps=stages.total_steps)
  batches = list(it)
  assert len(batches) == 7
  assert [b["inputs"].shape for b in batches] == [(32, 32)] * 3 + [(8, 128)] * 2 + [(2, 512)] * 2
  for step, b in enumerate(batches):
    ref = windows.batch(step, seq_len_fn(step))
    for k in ref:
      np.testing.assert_array_equal(b[k], ref[k])
  # The iterator state is the global step.
  it = make_train_iterator(cfg, 1024, seq_len_fn, start_step=2, corpus=builtin, prefetch=0)
  assert it.get_state() == {"next_index": 2}
  np.testing.assert_array_equal(next(it)["inputs"], batches[2]["inputs"])
  next(it)
  assert it.get_state() == {"next_index": 4}
  it.set_state({"next_index": 5})
  np.testing.assert_array_equal(next(it)["targets"], batches[5]["targets"])
  # Without num_steps the source is endless and later steps wrap around the stream.
  far = 10 * len(windows) // 1024
  it.set_state({"next_index": far})
  np.testing.assert_array_equal(next(it)["inputs"].reshape(-1), windows.window(far)[:-1])


def test_train_source_loads_corpus_and_checks_length():
  cfg = DataConfig(max_bytes=100_000)
  src = train_source(cfg, 256, lambda s: 64, num_steps=3)
  assert len(src) == 3 and src[2]["inputs"].shape == (4, 64)
  with pytest.raises(ValueError, match=r"StagesConfig.tokens_per_step = 1048576, plus one"):
    train_source(cfg, 2**20, lambda s: 1024)
  with pytest.raises(ValueError, match="seq_len=48 .* must divide"):
    train_source(cfg, 256, lambda s: 48)[0]


def test_synthetic_train_sources():
  mqar = train_source(DataConfig(source="mqar", seed=1), 256, lambda s: 64, vocab_size=64,
                      mqar_num_kv_pairs=4)
  a, b = mqar[3], mqar[3]
  assert a["inputs"].shape == (4, 64) and a["loss_mask"].sum() == 16
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(mqar[4]["inputs"], a["inputs"])
  with pytest.raises(ValueError, match="needs vocab_size"):
    train_source(DataConfig(source="mqar"), 256, lambda s: 64)
  passkey = train_source(DataConfig(source="passkey"), 512, lambda s: 256)
  assert passkey[0]["inputs"].shape == (2, 256) and passkey[0]["loss_mask"].sum() == 10


def test_validation_batches(builtin):
  vb = validation_batches(builtin, 256, 4, 3)
  again = validation_batches(builtin, 256, 4, 3)
  assert len(vb) == 3
  valid = builtin.valid_tokens
  m = valid.size
  for i, b in enumerate(vb):
    _check_batch(b, 256)
    np.testing.assert_array_equal(again[i]["targets"], b["targets"])
    for r in range(4):
      start = ((i * 4 + r) * m) // 12   # rows spread evenly over the whole split
      np.testing.assert_array_equal(b["inputs"][r], valid[start:start + 256])
      np.testing.assert_array_equal(b["targets"][r], valid[start + 1:start + 257])
  # The last row of a request longer than the split wraps around its end.
  n = m // 1024 + 1
  big = validation_batches(builtin, 1024, 1, n)[-1]
  start = ((n - 1) * m) // n
  np.testing.assert_array_equal(big["inputs"][0], np.take(valid, np.arange(start, start + 1024),
                                                          mode="wrap"))
  with pytest.raises(ValueError, match=r"seq_len=\d+ needs at least .* validation split has"):
    validation_batches(builtin, m, 1, 1)


def test_validation_split_must_hold_a_row_of_the_longest_stage():
  check_validation_size(1025, 1024)                 # one row of 1024 tokens + the lookahead
  with pytest.raises(ValueError, match="1024 tokens, plus one lookahead"):
    check_validation_size(1024, 1024)
  # With the corpus size, the message says which validation_fraction would do.
  cfg = DataConfig(validation_fraction=0.05)
  with pytest.raises(ValueError, match=r"validation_fraction \(now 0.05\) to about 0.13"):
    check_validation_size(500_000, 1_048_576, cfg, total_tokens=10_000_000)

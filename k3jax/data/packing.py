"""Packing token streams into batches indexed by global step, and the grain training iterator.

The training stream is cyclic. Global position g lies in epoch e = g // N (N = train stream length)
at offset g % N. Epoch 0 is `corpus.train_tokens` (documents already shuffled by the seed); every
later epoch re-shuffles the documents with `np.random.default_rng([seed, e])` (set
`reshuffle_each_epoch=False` to repeat epoch 0 instead).

Step s reads the P + 1 tokens at global positions [s*P, s*P + P] (P = tokens_per_step), whatever
the seq_len L of its stage: inputs = window[:P] reshaped to [P/L, L], targets = window[1:] reshaped
the same way (each row has one token of lookahead, so its last input has a target as well). The data
position is therefore exactly the global step, and changing L between stages neither skips nor
repeats tokens. One epoch is N / P steps.

Within a row, segment ids number the documents from 1: they increase by one at each BOS, except
at position 0, which is always segment 1 (a row that starts mid-document starts with segment 1).
loss_mask is 0 exactly where the target is BOS (the next document's start is not predictable from
the previous document) and 1 elsewhere; there is no padding.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, List, Optional

import grain
import numpy as np

from k3jax.data import synthetic
from k3jax.data.corpus import Corpus, load_corpus
from k3jax.data.tokenizers import make_tokenizer


def make_batch(window: np.ndarray, seq_len: int, bos_id: int) -> dict:
  """Rows of a packed window: window int32 [B*L + 1] -> dict of [B, L] arrays (see module doc)."""
  window = np.asarray(window, np.int32)
  n = window.size - 1
  if seq_len < 1 or n < seq_len or n % seq_len:
    raise ValueError(f"make_batch: a window of {window.size} tokens does not split into rows of "
                     f"seq_len={seq_len} plus one lookahead token")
  inputs = window[:-1].reshape(-1, seq_len)
  targets = window[1:].reshape(-1, seq_len)
  starts = inputs == bos_id
  starts[:, 0] = True
  return {"inputs": inputs, "targets": targets,
          "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
          "loss_mask": (targets != bos_id).astype(np.float32)}


def _source_text(data_cfg) -> str:
  """' of DataConfig.source = ..., path = ...' naming a split's data in a message ('' without)."""
  if data_cfg is None:
    return ""
  return f" of DataConfig.source = {data_cfg.source!r}, path = {data_cfg.path!r}"


def check_train_size(num_tokens: int, tokens_per_step: int, data_cfg=None) -> None:
  """ValueError naming the settings when a train stream of `num_tokens` cannot fill one step
  (tokens_per_step tokens plus one lookahead token). data_cfg (a DataConfig) names the source."""
  if num_tokens >= tokens_per_step + 1:
    return
  raise ValueError(f"the train split{_source_text(data_cfg)} has {num_tokens} tokens, fewer than "
                   f"one step needs (StagesConfig.tokens_per_step = {tokens_per_step}, plus one "
                   "lookahead token); use more data or lower StagesConfig.tokens_per_step")


def check_validation_size(num_tokens: int, longest_seq_len: int, data_cfg=None,
                          total_tokens: int = 0) -> None:
  """ValueError naming the settings when a validation split of `num_tokens` cannot fill one row
  of the longest stage (`longest_seq_len` tokens plus one lookahead token): every stage's
  evaluation reads rows of its own length, so a run would otherwise stop at the last stage's end,
  after all its training. total_tokens (train + validation) > 0 adds the validation_fraction
  that would do."""
  if num_tokens >= longest_seq_len + 1:
    return
  hint = "raise DataConfig.validation_fraction or use more data"
  if data_cfg is not None and total_tokens > 0:
    # Documents are assigned whole: ask for a margin over the exact fraction.
    need = min(0.49, 1.25 * (longest_seq_len + 1) / total_tokens)
    hint = (f"raise DataConfig.validation_fraction (now {data_cfg.validation_fraction}) to about "
            f"{need:.2f}, or use more data" if need > data_cfg.validation_fraction else hint)
  raise ValueError(f"the validation split{_source_text(data_cfg)} has {num_tokens} tokens, "
                   f"fewer than one evaluation row of the longest stage needs ({longest_seq_len} "
                   f"tokens, plus one lookahead token); {hint}")


class TokenWindows:
  """Cyclic, per-epoch re-shuffled view of a packed stream, read by global step.

  Args:
    tokens: int32 [N], a packed stream whose documents each start with `bos_id` (tokens[0] == BOS).
    bos_id: the document separator.
    tokens_per_step: P; the stream must hold at least P + 1 tokens.
    seed: seeds the re-shuffle of epochs >= 1.
    reshuffle_each_epoch: False repeats the stream unchanged every epoch.
  """

  def __init__(self, tokens: np.ndarray, bos_id: int, tokens_per_step: int, seed: int = 0,
               reshuffle_each_epoch: bool = True):
    tokens = np.asarray(tokens, np.int32)
    if tokens_per_step < 1:
      raise ValueError(f"StagesConfig.tokens_per_step={tokens_per_step} must be positive")
    check_train_size(tokens.size, tokens_per_step)
    if tokens[0] != bos_id:
      raise ValueError(f"TokenWindows: the stream must start with BOS ({bos_id}), got {tokens[0]}")
    self.tokens = tokens
    self.bos_id = bos_id
    self.tokens_per_step = tokens_per_step
    self.seed = seed
    self.reshuffle_each_epoch = reshuffle_each_epoch
    self._doc_starts = np.flatnonzero(tokens == bos_id)
    self._doc_lengths = np.diff(np.append(self._doc_starts, tokens.size))
    self._epoch_cache = None   # (epoch, doc order, cumulative lengths); a pure cache

  def __len__(self) -> int:
    return self.tokens.size

  @property
  def steps_per_epoch(self) -> float:
    return self.tokens.size / self.tokens_per_step

  def _epoch_layout(self, epoch: int):
    cached = self._epoch_cache   # one read: another thread may replace it meanwhile
    if cached is not None and cached[0] == epoch:
      return cached[1], cached[2]
    order = np.random.default_rng([self.seed, epoch]).permutation(self._doc_starts.size)
    ends = np.cumsum(self._doc_lengths[order])
    self._epoch_cache = (epoch, order, ends)
    return order, ends

  def _epoch_slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of epoch `epoch`'s stream (0 <= start < stop <= N)."""
    if epoch == 0 or not self.reshuffle_each_epoch:
      return self.tokens[start:stop]
    order, ends = self._epoch_layout(epoch)
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, stop, side="left"))
    parts = [self.tokens[self._doc_starts[d]:self._doc_starts[d] + self._doc_lengths[d]]
             for d in order[first:last + 1]]
    offset = start - (int(ends[first - 1]) if first > 0 else 0)
    return np.concatenate(parts)[offset:offset + stop - start]

  def take(self, position: int, length: int) -> np.ndarray:
    """int32 [length]: the tokens at global positions [position, position + length)."""
    n = self.tokens.size
    out = []
    while length > 0:
      epoch, offset = divmod(position, n)
      stop = min(n, offset + length)
      out.append(self._epoch_slice(epoch, offset, stop))
      length -= stop - offset
      position += stop - offset
    return np.concatenate(out) if out else np.zeros([0], np.int32)

  def window(self, step: int) -> np.ndarray:
    """int32 [P + 1]: global positions [step * P, step * P + P]."""
    if step < 0:
      raise ValueError(f"TokenWindows.window: step={step} must be >= 0")
    return self.take(step * self.tokens_per_step, self.tokens_per_step + 1)

  def batch(self, step: int, seq_len: int) -> dict:
    """The batch of global step `step` with rows of `seq_len`: [P / seq_len, seq_len] arrays."""
    if seq_len < 1 or self.tokens_per_step % seq_len:
      raise ValueError(f"seq_len={seq_len} must divide StagesConfig.tokens_per_step="
                       f"{self.tokens_per_step}")
    return make_batch(self.window(step), seq_len, self.bos_id)


class StageSeqLen:
  """step -> seq_len of the stage that global step belongs to (a picklable seq_len_fn)."""

  def __init__(self, stages_cfg):
    self.stages_cfg = stages_cfg

  def __call__(self, step: int) -> int:
    return self.stages_cfg.stages[self.stages_cfg.stage_at(step)][0]

  def __repr__(self) -> str:
    return f"StageSeqLen({self.stages_cfg.stages!r})"


class StepBatchSource:
  """grain random-access source: record `step` is the training batch of global step `step`.

  Args:
    batch_fn: (step, batch_size, seq_len) -> batch dict; must be a pure function of its arguments.
    tokens_per_step: P; batch_size = P // seq_len_fn(step).
    seq_len_fn: step -> seq_len (e.g. `StageSeqLen(stages_cfg)`); must divide P.
    num_steps: the source's length; None for an endless source.
  """

  def __init__(self, batch_fn: Callable[[int, int, int], dict], tokens_per_step: int,
               seq_len_fn: Callable[[int], int], num_steps: Optional[int] = None):
    self.batch_fn = batch_fn
    self.tokens_per_step = tokens_per_step
    self.seq_len_fn = seq_len_fn
    self.num_steps = num_steps

  def __len__(self) -> int:
    return sys.maxsize if self.num_steps is None else self.num_steps

  def __getitem__(self, step: int) -> dict:
    step = int(step)
    seq_len = int(self.seq_len_fn(step))
    if seq_len < 1 or self.tokens_per_step % seq_len:
      raise ValueError(f"seq_len={seq_len} (step {step}) must divide StagesConfig.tokens_per_step="
                       f"{self.tokens_per_step}")
    return self.batch_fn(step, self.tokens_per_step // seq_len, seq_len)

  def __repr__(self) -> str:
    return (f"StepBatchSource({self.batch_fn!r}, tokens_per_step={self.tokens_per_step}, "
            f"seq_len_fn={self.seq_len_fn!r}, num_steps={self.num_steps})")


def _corpus_batch(windows: TokenWindows, step: int, batch_size: int, seq_len: int) -> dict:
  del batch_size  # = tokens_per_step // seq_len by construction
  return windows.batch(step, seq_len)


def _mqar_batch(seed: int, vocab_size: int, num_kv_pairs: int, step: int, batch_size: int,
                seq_len: int) -> dict:
  return synthetic.mqar_batch(np.random.default_rng([seed, step]), batch_size, seq_len, vocab_size,
                              num_kv_pairs)


def _passkey_batch(seed: int, tokenizer, step: int, batch_size: int, seq_len: int) -> dict:
  return synthetic.passkey_batch(np.random.default_rng([seed, step]), batch_size, seq_len,
                                 tokenizer)


def train_source(data_cfg, tokens_per_step: int, seq_len_fn: Callable[[int], int], *,
                 corpus: Optional[Corpus] = None, num_steps: Optional[int] = None,
                 vocab_size: Optional[int] = None, mqar_num_kv_pairs: int = 8,
                 reshuffle_each_epoch: bool = True) -> StepBatchSource:
  """The training source of `data_cfg`, indexed by global step.

  Args:
    data_cfg: a `DataConfig`. 'mqar' draws step s's batch with rng [seed, s] over ids
      < vocab_size (required); 'passkey' uses the configured tokenizer and the fixed filler.
    tokens_per_step, seq_len_fn: see `StepBatchSource`.
    corpus: a corpus already loaded from data_cfg (loaded here when None).
    num_steps: source length; None: endless.
    vocab_size: the model's vocabulary size (used by 'mqar').
    mqar_num_kv_pairs: key-value pairs per MQAR row.
    reshuffle_each_epoch: see `TokenWindows`.
  """
  if data_cfg.source == "mqar":
    if vocab_size is None:
      raise ValueError("train_source: DataConfig.source='mqar' needs vocab_size (the model's)")
    fn = functools.partial(_mqar_batch, data_cfg.seed, vocab_size, mqar_num_kv_pairs)
  elif data_cfg.source == "passkey":
    tokenizer = make_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_path)
    fn = functools.partial(_passkey_batch, data_cfg.seed, tokenizer)
  else:
    corpus = corpus if corpus is not None else load_corpus(data_cfg)
    windows = TokenWindows(corpus.train_tokens, corpus.tokenizer.bos_id, tokens_per_step,
                           seed=corpus.seed, reshuffle_each_epoch=reshuffle_each_epoch)
    fn = functools.partial(_corpus_batch, windows)
  return StepBatchSource(fn, tokens_per_step, seq_len_fn, num_steps)


def make_train_iterator(data_cfg, tokens_per_step: int, seq_len_fn: Callable[[int], int],
                        start_step: int = 0, *, prefetch: int = 2, **source_kwargs):
  """A grain iterator over the training batches of global steps start_step, start_step + 1, ...

  The iterator's state is `{'next_index': global step of the next batch}`: `get_state()` after
  consuming step s returns s + 1, and `set_state({'next_index': s})` resumes at step s.
  Equivalently, re-create the iterator with start_step = s. One background thread prefetches
  `prefetch` batches.

  Args:
    data_cfg, tokens_per_step, seq_len_fn: see `train_source`.
    start_step: the first global step.
    prefetch: batches computed ahead (0: none).
    **source_kwargs: passed to `train_source` (corpus, num_steps, vocab_size, ...).
  """
  source = train_source(data_cfg, tokens_per_step, seq_len_fn, **source_kwargs)
  if prefetch > 0:
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
  else:
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  iterator = iter(grain.MapDataset.source(source).to_iter_dataset(options))
  iterator.set_state({"next_index": int(start_step)})
  return iterator


def validation_batches(data, seq_len: int, batch_size: int,
                       num_batches: int) -> List[dict]:
  """Fixed validation batches whose rows are spread evenly over the whole validation split.

  Row j of the R = num_batches * batch_size rows (batch j // batch_size) starts at token
  floor(j * M / R) of the validation stream (M tokens, no shuffling) and reads seq_len + 1 tokens,
  wrapping around the end; so a few batches sample every validation document rather than the first
  one only. Rows overlap only when R * seq_len > M.

  Args:
    data: a `Corpus`, or a `DataConfig` (loaded here).
    seq_len, batch_size, num_batches: each batch is [batch_size, seq_len].

  Raises:
    ValueError: non-positive sizes, or a validation split shorter than seq_len + 1 tokens.
  """
  corpus = data if isinstance(data, Corpus) else load_corpus(data)
  for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("num_batches", num_batches)):
    if v < 1:
      raise ValueError(f"validation_batches: {name}={v} must be positive")
  tokens = corpus.valid_tokens
  if tokens.size < seq_len + 1:
    raise ValueError(f"validation_batches: seq_len={seq_len} needs at least {seq_len + 1} tokens "
                     f"but the validation split has {tokens.size}; raise "
                     "DataConfig.validation_fraction or use more data")
  num_rows = num_batches * batch_size
  starts = (np.arange(num_rows, dtype=np.int64) * tokens.size) // num_rows
  rows = [make_batch(np.take(tokens, np.arange(st, st + seq_len + 1), mode="wrap"), seq_len,
                     corpus.tokenizer.bos_id) for st in starts]
  return [{k: np.concatenate([r[k] for r in rows[i * batch_size:(i + 1) * batch_size]])
           for k in rows[0]} for i in range(num_batches)]

"""Synthetic tasks: multi-query associative recall (MQAR) and passkey retrieval.

Both return the usual batch dict of numpy arrays, one document per row:
  inputs [B,T] int32, targets [B,T] int32, segment_ids [B,T] int32 (all 1),
  loss_mask [B,T] float32 (1 only where the task's answer is predicted).
`rng` is a `np.random.Generator` or anything `np.random.default_rng` accepts (an int seed).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from k3jax.data.tokenizers import ByteTokenizer, Tokenizer

MQAR_FILLER_ID = 0
PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
                  "back again. ")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = " What is the pass key? The pass key is "


def _batch(inputs: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray) -> dict:
  return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
          "segment_ids": np.ones(inputs.shape, np.int32),
          "loss_mask": loss_mask.astype(np.float32)}


def mqar_batch(rng, batch: int, seq_len: int, vocab_size: int, num_kv_pairs: int) -> dict:
  """Zoology-style MQAR: key-value pairs, then every key queried once at a random later position.

  Row layout: k1 v1 k2 v2 ... kK vK, then `seq_len - 2K` filler tokens (id 0) among which the K
  keys reappear in random order at random distinct positions. At a query position the target is
  that key's value (loss_mask 1); everywhere else target = 0 and loss_mask = 0. Keys are distinct
  within a row and drawn from [1, 1 + h), values from [1 + h, vocab_size),
  h = (vocab_size - 1) // 2.

  Args:
    rng: np.random.Generator or seed.
    batch, seq_len: output shape [batch, seq_len].
    vocab_size: ids used are < vocab_size (must fit the model's vocabulary).
    num_kv_pairs: K.

  Raises:
    ValueError: seq_len < 3K (no room for the queries) or a key/value range smaller than K.
  """
  rng = np.random.default_rng(rng)
  k = num_kv_pairs
  if batch < 1 or k < 1:
    raise ValueError(f"mqar_batch: batch={batch} and num_kv_pairs={k} must be positive")
  if seq_len < 3 * k:
    raise ValueError(f"mqar_batch: seq_len={seq_len} must be at least 3 * num_kv_pairs = {3 * k} "
                     "(K pairs take 2K tokens, K queries K more)")
  half = (vocab_size - 1) // 2
  if half < k:
    raise ValueError(f"mqar_batch: vocab_size={vocab_size} gives {half} keys and values; "
                     f"num_kv_pairs={k} needs vocab_size >= {2 * k + 1}")
  inputs = np.full([batch, seq_len], MQAR_FILLER_ID, np.int64)
  targets = np.zeros([batch, seq_len], np.int64)
  loss_mask = np.zeros([batch, seq_len], np.float32)
  rows = np.arange(batch)[:, None]
  keys = np.argsort(rng.random([batch, half]), axis=1)[:, :k] + 1           # distinct per row
  values = rng.integers(1 + half, vocab_size, size=[batch, k])
  inputs[:, 0:2 * k:2] = keys
  inputs[:, 1:2 * k:2] = values
  query_pos = 2 * k + np.sort(np.argsort(rng.random([batch, seq_len - 2 * k]), axis=1)[:, :k], 1)
  query_order = np.argsort(rng.random([batch, k]), axis=1)
  inputs[rows, query_pos] = keys[rows, query_order]
  targets[rows, query_pos] = values[rows, query_order]
  loss_mask[rows, query_pos] = 1.0
  return _batch(inputs, targets, loss_mask)


def mqar_accuracy(logits, batch: dict) -> float:
  """The fraction of MQAR queries whose value the greedy prediction gets exactly right.

  Each query position (loss_mask > 0) counts once: it is right when the argmax of its logits is
  the target (the queried key's value). The fraction is over every query of every row.

  Args:
    logits: [B, T, V] (numpy or jax), predictions for `batch['targets']`.
    batch: an `mqar_batch` (or any batch whose loss_mask marks the answer positions), or its
      'targets' and 'loss_mask' [B, T] cut to the positions the logits cover.

  Raises:
    ValueError: logits that do not match the batch's [B, T], or a batch with no query.
  """
  predictions = np.asarray(logits).argmax(-1)
  mask = np.asarray(batch["loss_mask"]) > 0
  if predictions.shape != mask.shape:
    raise ValueError(f"mqar_accuracy: logits have shape {np.shape(logits)}, expected "
                     f"[B, T, V] with [B, T] = {mask.shape}")
  if not mask.any():
    raise ValueError("mqar_accuracy: the batch's loss_mask marks no query")
  correct = (predictions == np.asarray(batch["targets"])) & mask
  return float(correct.sum() / mask.sum())


def passkey_batch(rng, batch: int, seq_len: int, tokenizer: Optional[Tokenizer] = None,
                  digits: int = 5, filler_tokens: Optional[np.ndarray] = None,
                  depth: Optional[float] = None) -> dict:
  """Passkey retrieval: find a number hidden at some depth of `seq_len` tokens of filler.

  Each row is the token sequence
    [BOS] filler[:a] needle filler[a:] question answer,    of length seq_len + 1,
  with needle = " The pass key is 12345. Remember it. 12345 is the pass key. ", question =
  " What is the pass key? The pass key is ", answer = the `digits` digits (first one non-zero).
  inputs = sequence[:-1], targets = sequence[1:]; loss_mask = 1 exactly on the targets that are
  answer tokens, so a row is solved when all of them are the argmax (see `passkey_accuracy`).

  Args:
    rng: np.random.Generator or seed (draws the keys and depths).
    batch, seq_len: output shape [batch, seq_len].
    tokenizer: defaults to the byte tokenizer.
    digits: number of digits of the key.
    filler_tokens: int ids to take the filler from (a random contiguous, cyclic slice per row; BOS
      ids are removed first), e.g. `corpus.valid_tokens`. None: the repeated fixed sentence
      `PASSKEY_FILLER`.
    depth: where the needle goes, as a fraction of the filler in [0, 1]; None: uniform per row.

  Raises:
    ValueError: seq_len too short for needle + question + answer, bad digits/depth/filler.
  """
  rng = np.random.default_rng(rng)
  tok = tokenizer if tokenizer is not None else ByteTokenizer()
  if batch < 1 or digits < 1:
    raise ValueError(f"passkey_batch: batch={batch} and digits={digits} must be positive")
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ValueError(f"passkey_batch: depth={depth} must be in [0, 1] or None")
  if filler_tokens is None:
    filler = tok.encode(PASSKEY_FILLER)
  else:
    filler = np.asarray(filler_tokens, np.int32).reshape(-1)
    filler = filler[filler != tok.bos_id]
    if filler.size == 0:
      raise ValueError("passkey_batch: filler_tokens holds no token besides BOS")
  question = tok.encode(PASSKEY_QUESTION)
  inputs = np.zeros([batch, seq_len], np.int64)
  targets = np.zeros([batch, seq_len], np.int64)
  loss_mask = np.zeros([batch, seq_len], np.float32)
  for b in range(batch):
    key = str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))
    needle = tok.encode(PASSKEY_NEEDLE.format(key=key))
    answer = tok.encode(key)
    fixed = 1 + needle.size + question.size + answer.size
    n_filler = seq_len + 1 - fixed
    if n_filler < 0:
      raise ValueError(f"passkey_batch: seq_len={seq_len} is too short; needle, question and a "
                       f"{digits}-digit answer need seq_len >= {fixed - 1}")
    start = int(rng.integers(0, filler.size)) if filler_tokens is not None else 0
    fill = np.take(filler, np.arange(start, start + n_filler), mode="wrap")
    a = int(round((rng.random() if depth is None else depth) * n_filler))
    seq = np.concatenate([[tok.bos_id], fill[:a], needle, fill[a:], question, answer])
    inputs[b] = seq[:-1]
    targets[b] = seq[1:]
    loss_mask[b, seq_len - answer.size:] = 1.0
  return _batch(inputs, targets, loss_mask)


def passkey_accuracy(logits, batch: dict) -> np.ndarray:
  """Per-row exact match of the greedy answer: bool [B].

  Args:
    logits: [B, T, V] (numpy or jax), predictions for `batch['targets']`.
    batch: a `passkey_batch` (or any batch whose loss_mask marks the answer tokens).
  """
  predictions = np.asarray(logits).argmax(-1)
  mask = np.asarray(batch["loss_mask"]) > 0
  if predictions.shape != mask.shape:
    raise ValueError(f"passkey_accuracy: logits have shape {np.shape(logits)}, expected "
                     f"[B, T, V] with [B, T] = {mask.shape}")
  correct = (predictions == np.asarray(batch["targets"])) | ~mask
  return correct.all(axis=1) & mask.any(axis=1)

"""The run's data, whatever its source (`DataConfig.source`): the training batches of each step,
fixed validation batches per length, the tokenizer, the passkey filler and bytes per token.

`make_data(cfg)` loads a corpus (text, builtin, ...) through `k3jax.data.corpus` and packs it
(`k3jax.data.packing`), or sets up a synthetic task (MQAR, passkey); it checks at start-up that the
train and validation splits can feed the stages, and that the tokenizer fits the model's
vocabulary, raising ConfigError with the setting to change.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from k3jax import config as config_lib
from k3jax.data import packing
from k3jax.data import synthetic
from k3jax.data.corpus import load_corpus
from k3jax.data.tokenizers import make_tokenizer

# Rows drawn per MQAR validation batch come from rng streams disjoint from the training steps'.
_SYNTHETIC_VALIDATION_OFFSET = 1 << 40


class Data(NamedTuple):
  """The run's data, whatever the source.

  train_iterator(start_step) yields the batches of steps start_step, start_step + 1, ...;
  validation_batches(seq_len, batch_size, num_batches) gives fixed validation batches.
  """
  train_iterator: Callable[[int], Any]
  validation_batches: Callable[[int, int, int], list]
  tokenizer: Any
  filler_tokens: Optional[np.ndarray]   # passkey filler (validation text), None: fixed sentence
  bytes_per_token: float


# ------------------------------------------------------------------------------------------------
# Set-up
# ------------------------------------------------------------------------------------------------

def make_data(cfg: config_lib.Config) -> Data:
  """Loads the corpus (or sets up the synthetic task) of `cfg.data`.

  Raises ConfigError (naming the DataConfig setting) when the data cannot be loaded.
  """
  dcfg, scfg = cfg.data, cfg.stages
  seq_len_fn = packing.StageSeqLen(scfg)
  try:
    if dcfg.source in ("mqar", "passkey"):
      tokenizer = make_tokenizer(dcfg.tokenizer, dcfg.tokenizer_path)

      def validation_batches(seq_len, batch_size, num_batches):
        rngs = [np.random.default_rng([dcfg.seed, _SYNTHETIC_VALIDATION_OFFSET + i])
                for i in range(num_batches)]
        if dcfg.source == "mqar":
          return [synthetic.mqar_batch(r, batch_size, seq_len, cfg.model.vocab_size,
                                       dcfg.mqar_num_kv_pairs) for r in rngs]
        return [synthetic.passkey_batch(r, batch_size, seq_len, tokenizer) for r in rngs]

      def train_iterator(start_step):
        return packing.make_train_iterator(dcfg, scfg.tokens_per_step, seq_len_fn, start_step,
                                           num_steps=scfg.total_steps,
                                           vocab_size=cfg.model.vocab_size,
                                           mqar_num_kv_pairs=dcfg.mqar_num_kv_pairs)
      if dcfg.source == "passkey":
        _check_vocab(cfg, tokenizer)
      bpt = 1.0 if dcfg.tokenizer == "byte" else float("nan")
      return Data(train_iterator, validation_batches, tokenizer, None, bpt)

    corpus = load_corpus(dcfg)
    packing.check_train_size(corpus.train_tokens.size, scfg.tokens_per_step, dcfg)
    packing.check_validation_size(corpus.valid_tokens.size, max(t for t, _ in scfg.stages), dcfg,
                                  corpus.train_tokens.size + corpus.valid_tokens.size)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e

  def validation_batches(seq_len, batch_size, num_batches):
    return packing.validation_batches(corpus, seq_len, batch_size, num_batches)

  def train_iterator(start_step):
    return packing.make_train_iterator(dcfg, scfg.tokens_per_step, seq_len_fn, start_step,
                                       corpus=corpus, num_steps=scfg.total_steps)
  _check_vocab(cfg, corpus.tokenizer)
  filler = corpus.valid_tokens if corpus.valid_tokens.size else None
  return Data(train_iterator, validation_batches, corpus.tokenizer, filler, bytes_per_token(corpus))


def bytes_per_token(corpus) -> float:
  """Average UTF-8 bytes per (non-BOS) token of the validation stream; 1 for the byte tokenizer."""
  tok = corpus.tokenizer
  if type(tok).__name__ == "ByteTokenizer":
    return 1.0
  ids = np.asarray(corpus.valid_tokens)
  ids = ids[ids != tok.bos_id]
  n_bytes = len(tok.decode(ids).encode("utf-8"))
  return n_bytes / max(ids.size, 1)


def _check_vocab(cfg: config_lib.Config, tokenizer) -> None:
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise config_lib.ConfigError(
        f"ModelConfig.vocab_size = {cfg.model.vocab_size} is not allowed: it must be at least the "
        f"tokenizer's vocab_size {tokenizer.vocab_size} ({tokenizer!r})")

"""Data: the builtin corpus and user files, tokenizers, step-indexed packing, synthetic tasks.

Typical use by the trainer:

  corpus = load_corpus(cfg.data)
  it = make_train_iterator(cfg.data, cfg.stages.tokens_per_step, StageSeqLen(cfg.stages),
                           start_step, corpus=corpus, num_steps=cfg.stages.total_steps)
  batch = next(it)            # dict of numpy arrays [B, L]; B * L = tokens_per_step
  valid = validation_batches(corpus, seq_len, batch_size, cfg.eval.num_batches)
"""

from k3jax.data.corpus import Corpus, iter_documents, load_corpus, load_documents
from k3jax.data.packing import (StageSeqLen, StepBatchSource, TokenWindows, make_batch,
                                make_train_iterator, train_source, validation_batches)
from k3jax.data.synthetic import mqar_accuracy, mqar_batch, passkey_accuracy, passkey_batch
from k3jax.data.tokenizers import (ByteTokenizer, SentencePieceTokenizer, TiktokenTokenizer,
                                   make_tokenizer)

__all__ = [
    "ByteTokenizer", "Corpus", "SentencePieceTokenizer", "StageSeqLen", "StepBatchSource",
    "TiktokenTokenizer", "TokenWindows", "iter_documents", "load_corpus", "load_documents",
    "make_batch", "make_tokenizer", "make_train_iterator", "mqar_accuracy", "mqar_batch",
    "passkey_accuracy", "passkey_batch", "train_source", "validation_batches",
]

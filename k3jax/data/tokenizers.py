"""Tokenizers: byte-level by default; SentencePiece or tiktoken from a local model file.

Every tokenizer has the same small surface:
  vocab_size: int       ids are in [0, vocab_size)
  bos_id: int           the document separator; every packed document starts with it
  encode(text) -> np.ndarray int32 [n]   never emits bos_id
  decode(ids) -> str    undecodable bytes become U+FFFD (errors='replace'); bos_id is dropped

The optional libraries are imported only when their tokenizer is built, so the byte tokenizer needs
nothing beyond numpy.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence, Union

import numpy as np

IdsLike = Union[np.ndarray, Sequence[int]]

# The cl100k_base pre-tokenisation pattern; a local .tiktoken file holds only the BPE ranks.
_TIKTOKEN_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}|"""
                     r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
_TIKTOKEN_BOS = "<|endoftext|>"


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int

  def encode(self, text: str) -> np.ndarray:
    ...

  def decode(self, ids: IdsLike) -> str:
    ...


class ByteTokenizer:
  """UTF-8 bytes: ids 0..255 are bytes, 256 is BOS; vocab_size 257."""

  vocab_size = 257
  bos_id = 256

  def encode(self, text: str) -> np.ndarray:
    """Returns the UTF-8 bytes of `text` as int32 [len(utf8)]."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """Token ids of raw bytes (already-validated UTF-8), int32 [len(data)]."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids: IdsLike) -> str:
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ValueError(f"ByteTokenizer.decode: ids must be in [0, {self.vocab_size}); got range "
                       f"[{ids.min()}, {ids.max()}]")
    return ids[ids != self.bos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


def _import_optional(module: str, pip_name: str, tokenizer: str):
  try:
    return __import__(module)
  except ImportError as e:
    raise ValueError(f"DataConfig.tokenizer={tokenizer!r} needs the {module!r} library, which is "
                     f"not installed: pip install {pip_name}") from e


class SentencePieceTokenizer:
  """A SentencePiece model file. BOS is the model's bos id, or its eos id when it has no bos."""

  def __init__(self, model_path: str):
    spm = _import_optional("sentencepiece", "sentencepiece", "sentencepiece")
    if not os.path.isfile(model_path):
      raise ValueError(f"DataConfig.tokenizer_path={model_path!r} is not an existing file")
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self._path = model_path
    self.vocab_size = int(self._sp.get_piece_size())
    bos = int(self._sp.bos_id())
    if bos < 0:
      bos = int(self._sp.eos_id())
    if bos < 0:
      raise ValueError(f"DataConfig.tokenizer_path={model_path!r}: the SentencePiece model has "
                       "neither a bos nor an eos piece, so documents cannot be separated")
    self.bos_id = bos

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), dtype=np.int32)

  def decode(self, ids: IdsLike) -> str:
    ids = np.asarray(ids).reshape(-1)
    return self._sp.decode([int(i) for i in ids if i != self.bos_id])

  def __repr__(self) -> str:
    return f"SentencePieceTokenizer({self._path!r})"


class TiktokenTokenizer:
  """A local tiktoken BPE file (lines 'base64-token rank'), cl100k pre-tokenisation.

  BOS is an extra special token '<|endoftext|>' with id = number of ranks; vocab_size = ranks + 1.
  """

  def __init__(self, model_path: str):
    tiktoken = _import_optional("tiktoken", "tiktoken", "tiktoken")
    import tiktoken.load  # noqa: F401  (the submodule is not imported by the package)
    if not os.path.isfile(model_path):
      raise ValueError(f"DataConfig.tokenizer_path={model_path!r} is not an existing file")
    ranks = tiktoken.load.load_tiktoken_bpe(model_path)
    if not ranks:
      raise ValueError(f"DataConfig.tokenizer_path={model_path!r} holds no BPE ranks")
    self._path = model_path
    self.bos_id = max(ranks.values()) + 1
    self.vocab_size = self.bos_id + 1
    self._enc = tiktoken.Encoding(name=os.path.basename(model_path), pat_str=_TIKTOKEN_PATTERN,
                                  mergeable_ranks=ranks,
                                  special_tokens={_TIKTOKEN_BOS: self.bos_id})

  def encode(self, text: str) -> np.ndarray:
    # encode_ordinary never produces special tokens, so a literal '<|endoftext|>' in a document
    # stays text and cannot fake a document boundary.
    return np.asarray(self._enc.encode_ordinary(text), dtype=np.int32)

  def decode(self, ids: IdsLike) -> str:
    ids = np.asarray(ids).reshape(-1)
    return self._enc.decode([int(i) for i in ids if i != self.bos_id], errors="replace")

  def __repr__(self) -> str:
    return f"TiktokenTokenizer({self._path!r})"


def make_tokenizer(name: str = "byte", path: str = "") -> Tokenizer:
  """Builds the tokenizer `name` ('byte' | 'sentencepiece' | 'tiktoken'); `path` is the model file.

  Raises:
    ValueError: unknown name, missing model file, or the optional library is not installed (the
      message names the pip package).
  """
  if name == "byte":
    return ByteTokenizer()
  if name in ("sentencepiece", "tiktoken") and not path:
    raise ValueError(f"DataConfig.tokenizer_path is empty; tokenizer={name!r} needs a model file")
  if name == "sentencepiece":
    return SentencePieceTokenizer(path)
  if name == "tiktoken":
    return TiktokenTokenizer(path)
  raise ValueError(f"DataConfig.tokenizer={name!r} is not allowed: one of ('byte', "
                   "'sentencepiece', 'tiktoken')")

"""Tokenizers: byte-level by default; SentencePiece or tiktoken from a local model file; Kimi's.

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
# Kimi's pre-tokenisation (its release's tokenization_kimi.py): runs of Han characters apart,
# cased words without Han, up to three digits, punctuation runs, newlines, spaces. `&&` is a
# character-class intersection, which tiktoken's regex engine supports.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "*" + _NOT_HAN_LOWER + "+" + _CONTRACTIONS,
    r"[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "+" + _NOT_HAN_LOWER + "*" + _CONTRACTIONS,
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# Kimi reserves this many ids after the BPE ranks for special tokens (named ones come from
# tokenizer_config.json's added_tokens_decoder).
KIMI_RESERVED_SPECIAL = 258


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
    return f"{type(self).__name__}({self._path!r})"


class KimiTokenizer(TiktokenTokenizer):
  """Kimi's tokenizer (Kimi-Linear, K2, K3): the release's `tiktoken.model` BPE ranks, its
  pre-tokenisation (KIMI_PATTERN), and the special tokens named in the `tokenizer_config.json`
  beside it (`added_tokens_decoder`: id -> {'content': ...}; ids from the number of ranks on).
  BOS is its `bos_token` ('[BOS]'). vocab_size is one past the largest id it can produce (a named
  special token or a rank); the model's embedding may be larger. Encoding and decoding are
  TiktokenTokenizer's.
  """

  def __init__(self, model_path: str):
    tiktoken = _import_optional("tiktoken", "tiktoken", "kimi")
    import tiktoken.load  # noqa: F401  (the submodule is not imported by the package)
    import json  # pylint: disable=import-outside-toplevel
    if not os.path.isfile(model_path):
      raise ValueError(f"DataConfig.tokenizer_path={model_path!r} is not an existing file")
    config_path = os.path.join(os.path.dirname(model_path), "tokenizer_config.json")
    if not os.path.isfile(config_path):
      raise ValueError(f"DataConfig.tokenizer='kimi' needs tokenizer_config.json beside "
                       f"{model_path!r} (the special tokens)")
    with open(config_path) as f:
      config = json.load(f)
    ranks = tiktoken.load.load_tiktoken_bpe(model_path)
    base = len(ranks)
    named = {int(i): (t["content"] if isinstance(t, dict) else str(t))
             for i, t in config.get("added_tokens_decoder", {}).items()}
    special = {named.get(i, f"<|reserved_token_{i}|>"): i
               for i in range(base, base + KIMI_RESERVED_SPECIAL)}
    special.update({content: i for i, content in named.items()})
    bos = config.get("bos_token", "[BOS]")
    bos = bos["content"] if isinstance(bos, dict) else bos
    if bos not in special:
      raise ValueError(f"{config_path}: bos_token {bos!r} is not among its added_tokens_decoder")
    self._path = model_path
    self.bos_id = special[bos]
    self.vocab_size = max([base - 1] + list(named)) + 1
    self._enc = tiktoken.Encoding(name=os.path.basename(model_path), pat_str=KIMI_PATTERN,
                                  mergeable_ranks=ranks, special_tokens=special)


TOKENIZERS = ("byte", "sentencepiece", "tiktoken", "kimi")


def make_tokenizer(name: str = "byte", path: str = "") -> Tokenizer:
  """Builds the tokenizer `name` (one of TOKENIZERS); `path` is the model file (for 'kimi', the
  release's tiktoken.model, with tokenizer_config.json beside it).

  Raises:
    ValueError: unknown name, missing model file, or the optional library is not installed (the
      message names the pip package).
  """
  if name == "byte":
    return ByteTokenizer()
  if name in TOKENIZERS and not path:
    raise ValueError(f"DataConfig.tokenizer_path is empty; tokenizer={name!r} needs a model file")
  if name == "sentencepiece":
    return SentencePieceTokenizer(path)
  if name == "tiktoken":
    return TiktokenTokenizer(path)
  if name == "kimi":
    return KimiTokenizer(path)
  raise ValueError(f"DataConfig.tokenizer={name!r} is not allowed: one of {TOKENIZERS}")

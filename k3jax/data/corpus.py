"""Documents from the builtin corpus or user files, split by document, packed into token streams.

Sources (`DataConfig.source`):
  'builtin'  The running Python's standard library: its .py, .txt and .rst files, excluding
             site-packages and test folders, and skipping files that are not UTF-8. Files are taken
             in a fixed order (sorted by a hash of their relative path, so the subset mixes all
             packages instead of an alphabetical prefix); each file is taken when it still fits
             under `DataConfig.max_bytes` in total, and skipped otherwise. The text therefore
             depends on the Python version, and on nothing else.
  'text'     A text file, or a folder of text files (recursive, sorted by relative path; hidden
             files and folders are skipped). Each file is one document and must be UTF-8.
  'jsonl'    A .jsonl file, or a folder of .jsonl files (recursive, sorted). Each non-blank line is
             a JSON object whose `DataConfig.jsonl_field` is a string: one document.
  'tokens'   A .npy file of token ids of the configured tokenizer, one of:
               * 1-D integer array: a token stream in which `tokenizer.bos_id` separates documents
                 (a leading BOS is optional; empty documents are dropped);
               * 2-D integer array: each row is one document (no BOS inside);
               * 1-D object array of 1-D integer arrays (ragged): each element is one document
                 (no BOS inside). Object arrays are unpickled, so only load files you trust.

Split: a document goes to validation when a hash of its key (relative path; 'path:line' for JSONL;
'doc<i>' for token files) maps below `validation_fraction`, independently of the seed. Should that
leave validation empty, the document with the smallest hash goes there; should it leave train empty,
the one with the largest hash stays in train. A source with a single document (e.g. one text file)
is split inside it instead: its last `validation_fraction` of tokens is validation.

Packing: each document becomes [BOS] + tokens. Train documents are shuffled once by
`DataConfig.seed`; validation documents keep the source order. Empty documents are dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from typing import Iterator, List, Optional, Tuple

import numpy as np

from k3jax.data.tokenizers import ByteTokenizer, Tokenizer, make_tokenizer

BUILTIN_SUFFIXES = (".py", ".txt", ".rst")
# Folder names never read for the builtin corpus: installed packages, test suites, caches.
BUILTIN_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                                   "__pycache__"})

Document = Tuple[str, np.ndarray]   # (key for the split, int32 token ids without BOS)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Packed token streams of one data config.

  Attributes:
    train_tokens: int32 [N], train documents, each as [BOS] + tokens, in the seed's shuffled order.
    valid_tokens: int32 [M], validation documents, same packing, source order.
    tokenizer: the tokenizer of both streams (its `bos_id` starts every document).
    seed: the seed that shuffled train_tokens (also used to re-shuffle later epochs).
    num_train_docs, num_valid_docs: document counts.
  """
  train_tokens: np.ndarray
  valid_tokens: np.ndarray
  tokenizer: Tokenizer
  seed: int = 0
  num_train_docs: int = 0
  num_valid_docs: int = 0


def _unit_hash(key: str, salt: str) -> float:
  """A deterministic float in [0, 1) from `key` (stable across processes, unlike hash())."""
  digest = hashlib.blake2b(f"{salt}:{key}".encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def builtin_files(stdlib_dir: Optional[str] = None) -> List[Tuple[str, str]]:
  """(relative path, absolute path) of every candidate builtin file, in the corpus order."""
  root = stdlib_dir or sysconfig.get_paths()["stdlib"]
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in BUILTIN_EXCLUDED_DIRS and not d.startswith(".")]
    for name in filenames:
      if name.endswith(BUILTIN_SUFFIXES):
        full = os.path.join(dirpath, name)
        found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
  found.sort(key=lambda f: (_unit_hash(f[0], "order"), f[0]))
  return found


def _builtin_documents(max_bytes: int, tokenizer: Tokenizer) -> List[Document]:
  docs, total = [], 0
  for rel, full in builtin_files():
    # Files that would pass the cap are skipped, so small caps still get whole documents.
    if os.path.islink(full) or total + os.path.getsize(full) > max_bytes:
      continue
    with open(full, "rb") as f:
      data = f.read()
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError:
      continue
    tokens = (tokenizer.encode_bytes(data) if isinstance(tokenizer, ByteTokenizer)
              else tokenizer.encode(text))
    docs.append((rel, tokens))
    total += len(data)
  return docs


def _files_under(path: str, suffixes: Optional[Tuple[str, ...]] = None) -> List[Tuple[str, str]]:
  """(relative path, absolute path) of the files at `path`, recursive, sorted by relative path."""
  if os.path.isfile(path):
    return [(os.path.basename(path), path)]
  found = []
  for dirpath, dirnames, filenames in os.walk(path):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for name in filenames:
      if name.startswith(".") or (suffixes and not name.endswith(suffixes)):
        continue
      full = os.path.join(dirpath, name)
      found.append((os.path.relpath(full, path).replace(os.sep, "/"), full))
  return sorted(found)


def _read_utf8(full: str) -> str:
  with open(full, "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"DataConfig.path: {full!r} is not UTF-8 text ({e})") from e


def _text_documents(path: str, tokenizer: Tokenizer) -> List[Document]:
  return [(rel, tokenizer.encode(_read_utf8(full))) for rel, full in _files_under(path)]


def _jsonl_documents(path: str, field: str, tokenizer: Tokenizer) -> List[Document]:
  docs = []
  for rel, full in _files_under(path, (".jsonl",)):
    for lineno, line in enumerate(_read_utf8(full).splitlines(), start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"DataConfig.path: {full!r} line {lineno} is not JSON ({e})") from e
      if not isinstance(record, dict) or not isinstance(record.get(field), str):
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"DataConfig.jsonl_field={field!r}: {full!r} line {lineno} has no string "
                         f"field {field!r} (found: {found})")
      docs.append((f"{rel}:{lineno}", tokenizer.encode(record[field])))
  return docs


def _check_ids(ids: np.ndarray, tokenizer: Tokenizer, path: str, what: str) -> np.ndarray:
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"DataConfig.path={path!r}: {what} must hold integer token ids, got dtype "
                     f"{ids.dtype}")
  if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
    raise ValueError(f"DataConfig.path={path!r}: token ids must be in [0, {tokenizer.vocab_size}) "
                     f"for {tokenizer!r}; {what} has range [{ids.min()}, {ids.max()}]")
  return ids.astype(np.int32)


def _token_documents(path: str, tokenizer: Tokenizer) -> List[Document]:
  if not (os.path.isfile(path) and path.endswith(".npy")):
    raise ValueError(f"DataConfig.path={path!r}: source='tokens' needs a .npy file")
  try:
    arr = np.load(path, allow_pickle=False)
  except ValueError:   # an object (ragged) array; see the module docstring
    arr = np.load(path, allow_pickle=True)
  bos = tokenizer.bos_id
  if arr.dtype == object:
    if arr.ndim != 1:
      raise ValueError(f"DataConfig.path={path!r}: a ragged token file must be a 1-D object array "
                       f"of 1-D arrays, got shape {arr.shape}")
    rows = [np.asarray(r) for r in arr]
    if any(r.ndim != 1 for r in rows):
      raise ValueError(f"DataConfig.path={path!r}: every document of a ragged token file must be "
                       "a 1-D array")
  elif arr.ndim == 2:
    rows = list(arr)
  elif arr.ndim == 1:
    stream = _check_ids(arr, tokenizer, path, "the token stream")
    cuts = np.flatnonzero(stream == bos)
    rows = [r for r in np.split(stream, cuts) if r.size]
    rows = [r[1:] if r[0] == bos else r for r in rows]
  else:
    raise ValueError(f"DataConfig.path={path!r}: a token file must be 1-D or 2-D, got shape "
                     f"{arr.shape}")
  docs = []
  for i, row in enumerate(rows):
    row = _check_ids(row, tokenizer, path, f"document {i}")
    if arr.ndim != 1 or arr.dtype == object:
      if np.any(row == bos):
        raise ValueError(f"DataConfig.path={path!r}: document {i} contains the BOS id {bos}; "
                         "documents of 2-D or ragged token files must not contain BOS")
    docs.append((f"doc{i}", row))
  return docs


def load_documents(data_cfg, tokenizer: Tokenizer) -> List[Document]:
  """All non-empty documents of `data_cfg` as (key, int32 ids without BOS), in source order.

  Raises:
    ValueError: missing path, unreadable or malformed files, or no non-empty document at all.
  """
  source = data_cfg.source
  if source in ("mqar", "passkey"):
    raise ValueError(f"DataConfig.source={source!r} is a synthetic task without a corpus; use "
                     "k3jax.data.synthetic (or train_source) instead of load_corpus")
  if source == "builtin":
    docs = _builtin_documents(data_cfg.max_bytes, tokenizer)
    where = f"the builtin corpus with DataConfig.max_bytes={data_cfg.max_bytes}"
  else:
    path = data_cfg.path
    if not path:
      raise ValueError(f"DataConfig.path is empty; source={source!r} needs a file or folder")
    if not os.path.exists(path):
      raise ValueError(f"DataConfig.path={path!r} does not exist")
    if source == "text":
      docs = _text_documents(path, tokenizer)
    elif source == "jsonl":
      docs = _jsonl_documents(path, data_cfg.jsonl_field, tokenizer)
    elif source == "tokens":
      docs = _token_documents(path, tokenizer)
    else:
      raise ValueError(f"DataConfig.source={source!r} is not allowed: one of ('builtin', 'text', "
                       "'jsonl', 'tokens', 'mqar', 'passkey')")
    where = f"DataConfig.path={path!r} (source={source!r})"
  docs = [(k, t) for k, t in docs if t.size > 0]
  if not docs:
    raise ValueError(f"no data: {where} gives no non-empty document")
  return docs


def split_documents(docs: List[Document], validation_fraction: float
                    ) -> Tuple[List[Document], List[Document]]:
  """(train, validation) documents by the hash of each key; see the module docstring."""
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(f"DataConfig.validation_fraction={validation_fraction} must be in (0, 1)")
  if len(docs) == 1:
    key, tokens = docs[0]
    if tokens.size < 2:
      raise ValueError(f"no data to split: the only document ({key!r}) has {tokens.size} token(s); "
                       "train and validation need at least one each")
    n_valid = min(tokens.size - 1, max(1, int(tokens.size * validation_fraction)))
    return [(key, tokens[:-n_valid])], [(key + "#valid", tokens[-n_valid:])]
  u = np.array([_unit_hash(k, "split") for k, _ in docs])
  is_valid = u < validation_fraction
  if not is_valid.any():
    is_valid[np.argmin(u)] = True
  if is_valid.all():
    is_valid[np.argmax(u)] = False
  train = [d for d, v in zip(docs, is_valid) if not v]
  valid = [d for d, v in zip(docs, is_valid) if v]
  return train, valid


def pack_documents(docs: List[Document], bos_id: int) -> np.ndarray:
  """int32 [sum(len + 1)]: each document as [BOS] + tokens, concatenated in the given order."""
  parts = []
  for _, tokens in docs:
    parts.append(np.array([bos_id], np.int32))
    parts.append(tokens.astype(np.int32, copy=False))
  return np.concatenate(parts) if parts else np.zeros([0], np.int32)


def load_corpus(data_cfg) -> Corpus:
  """Reads, tokenizes, splits and packs the documents of `data_cfg` (a `DataConfig`).

  Deterministic: the same config (and Python version, for 'builtin') gives the same arrays.

  Raises:
    ValueError: naming the setting (DataConfig.path, .source, .tokenizer, ...) that is wrong, or
      when there is no data.
  """
  tokenizer = make_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_path)
  docs = load_documents(data_cfg, tokenizer)
  train, valid = split_documents(docs, data_cfg.validation_fraction)
  order = np.random.default_rng(data_cfg.seed).permutation(len(train))
  train = [train[i] for i in order]
  return Corpus(train_tokens=pack_documents(train, tokenizer.bos_id),
                valid_tokens=pack_documents(valid, tokenizer.bos_id),
                tokenizer=tokenizer, seed=data_cfg.seed,
                num_train_docs=len(train), num_valid_docs=len(valid))


def iter_documents(tokens: np.ndarray, bos_id: int) -> Iterator[np.ndarray]:
  """The documents of a packed stream (each without its BOS), in order."""
  starts = np.flatnonzero(tokens == bos_id)
  ends = np.append(starts[1:], tokens.size)
  for s, e in zip(starts, ends):
    yield tokens[s + 1:e]

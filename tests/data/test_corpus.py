"""Corpus loading: builtin stdlib text, user files, split by document, tokenizers, errors."""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import sysconfig

import numpy as np
import pytest

from k3jax.config import DataConfig
from k3jax.data import tokenizers
from k3jax.data.corpus import iter_documents, load_corpus, load_documents, split_documents

BOS = 256


@pytest.fixture(scope="module")
def builtin():
  return load_corpus(DataConfig())


def _docs(tokens):
  return [bytes(d.astype(np.uint8)) for d in iter_documents(tokens, BOS)]


def test_builtin_is_deterministic_real_text(builtin):
  again = load_corpus(DataConfig())
  np.testing.assert_array_equal(builtin.train_tokens, again.train_tokens)
  np.testing.assert_array_equal(builtin.valid_tokens, again.valid_tokens)
  assert builtin.train_tokens.dtype == np.int32 and builtin.train_tokens[0] == BOS
  assert builtin.tokenizer.vocab_size == 257 and builtin.tokenizer.bos_id == BOS
  docs = _docs(builtin.train_tokens) + _docs(builtin.valid_tokens)
  assert len(docs) == builtin.num_train_docs + builtin.num_valid_docs
  for d in docs:
    d.decode("utf-8")   # every document is valid UTF-8 (strict)
  text = b"".join(docs)
  assert text.count(b"def ") > 1000 and text.count(b"import ") > 100
  total = len(text)
  assert 0.9 * DataConfig().max_bytes < total <= DataConfig().max_bytes


def test_builtin_documents_are_whole_stdlib_files():
  cfg = DataConfig(max_bytes=300_000)
  root = sysconfig.get_paths()["stdlib"]
  docs = load_documents(cfg, tokenizers.ByteTokenizer())
  assert sum(t.size for _, t in docs) <= 300_000
  for key, tokens in docs:
    parts = key.split("/")
    assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages"}, key
    assert key.endswith((".py", ".txt", ".rst"))
    with open(os.path.join(root, key), "rb") as f:
      assert f.read() == bytes(tokens.astype(np.uint8)), key


def test_split_is_disjoint_by_document_and_independent_of_seed(builtin):
  docs = load_documents(DataConfig(), tokenizers.ByteTokenizer())
  train, valid = split_documents(docs, 0.05)
  train_keys, valid_keys = {k for k, _ in train}, {k for k, _ in valid}
  assert not train_keys & valid_keys
  assert train_keys | valid_keys == {k for k, _ in docs}
  assert valid_keys
  # The packed streams hold exactly those documents (train shuffled, validation in source order).
  by_key = {k: bytes(t.astype(np.uint8)) for k, t in docs}
  assert _docs(builtin.valid_tokens) == [by_key[k] for k, _ in valid]
  assert collections.Counter(_docs(builtin.train_tokens)) == collections.Counter(
      by_key[k] for k, _ in train)
  other_seed = load_corpus(DataConfig(seed=1))
  np.testing.assert_array_equal(other_seed.valid_tokens, builtin.valid_tokens)
  assert not np.array_equal(other_seed.train_tokens, builtin.train_tokens)
  assert collections.Counter(_docs(other_seed.train_tokens)) == collections.Counter(
      _docs(builtin.train_tokens))


def test_split_fraction_and_fallbacks():
  docs = [(f"doc{i}", np.arange(3, dtype=np.int32)) for i in range(2000)]
  train, valid = split_documents(docs, 0.1)
  assert 140 < len(valid) < 260 and len(train) + len(valid) == 2000
  # Two documents with a tiny fraction: one still goes to validation, one stays in train.
  train, valid = split_documents(docs[:2], 1e-6)
  assert len(train) == 1 and len(valid) == 1
  # A single document is split inside: its last fraction of tokens is validation.
  one = [("only", np.arange(100, dtype=np.int32))]
  train, valid = split_documents(one, 0.1)
  np.testing.assert_array_equal(train[0][1], np.arange(90))
  np.testing.assert_array_equal(valid[0][1], np.arange(90, 100))


def test_byte_tokenizer_round_trip():
  tok = tokenizers.ByteTokenizer()
  text = "héllo wörld — ∑ 😀\n\ttabs"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  assert list(ids) == list(text.encode("utf-8"))
  assert tok.decode(ids) == text
  assert tok.decode(np.concatenate([[BOS], ids, [BOS]])) == text
  assert tok.decode([0xE2, 0x82]) == "\ufffd"   # a truncated character is replaced, not an error
  with pytest.raises(ValueError, match="ids must be in"):
    tok.decode([257])


def test_text_file_and_folder(tmp_path):
  f = tmp_path / "single.txt"
  f.write_text("abcdefghij" * 10)
  c = load_corpus(DataConfig(source="text", path=str(f), validation_fraction=0.1))
  text = c.tokenizer.decode(c.train_tokens) + c.tokenizer.decode(c.valid_tokens)
  assert text == "abcdefghij" * 10
  assert c.valid_tokens.size == 1 + 10

  folder = tmp_path / "docs"
  (folder / "sub").mkdir(parents=True)
  (folder / ".hidden").write_text("never read")
  texts = {f"a{i}.txt": f"document number {i} " * (i + 1) for i in range(30)}
  texts["sub/z.md"] = "nested"
  texts["empty.txt"] = ""
  for name, t in texts.items():
    (folder / name).write_text(t)
  cfg = DataConfig(source="text", path=str(folder), validation_fraction=0.2)
  c = load_corpus(cfg)
  got = [bytes(d.astype(np.uint8)).decode() for d in iter_documents(c.train_tokens, BOS)]
  got += [bytes(d.astype(np.uint8)).decode() for d in iter_documents(c.valid_tokens, BOS)]
  assert sorted(got) == sorted(t for t in texts.values() if t)
  assert c.num_valid_docs >= 1 and c.num_train_docs >= 1
  c2 = load_corpus(cfg)
  np.testing.assert_array_equal(c.train_tokens, c2.train_tokens)


def test_jsonl(tmp_path):
  f = tmp_path / "data.jsonl"
  rows = [{"text": f"line {i} ünïcode", "id": i} for i in range(40)]
  f.write_text("\n".join(json.dumps(r) for r in rows[:20]) + "\n\n" +
               "\n".join(json.dumps(r) for r in rows[20:]) + "\n")
  c = load_corpus(DataConfig(source="jsonl", path=str(f)))
  got = [bytes(d.astype(np.uint8)).decode() for t in (c.train_tokens, c.valid_tokens)
         for d in iter_documents(t, BOS)]
  assert sorted(got) == sorted(r["text"] for r in rows)
  g = tmp_path / "other.jsonl"
  g.write_text(json.dumps({"body": "xyz"}) + "\n")
  with pytest.raises(ValueError, match=r"DataConfig.jsonl_field='text'.*line 1"):
    load_corpus(DataConfig(source="jsonl", path=str(g)))
  c = load_corpus(DataConfig(source="jsonl", path=str(g), jsonl_field="body"))
  assert c.tokenizer.decode(c.train_tokens) + c.tokenizer.decode(c.valid_tokens) == "xyz"


def test_npy_token_files(tmp_path):
  docs = [np.arange(i + 5, dtype=np.int32) % 256 for i in range(12)]
  stream = np.concatenate([np.concatenate([[BOS], d]) for d in docs]).astype(np.int64)
  ragged = np.empty(len(docs), dtype=object)
  ragged[:] = docs
  square = np.stack([np.full(7, i, np.int32) for i in range(12)])
  expected = {"stream": docs, "no_leading_bos": docs, "ragged": docs, "square": list(square)}
  arrays = {"stream": stream, "no_leading_bos": stream[1:], "ragged": ragged, "square": square}
  for name, arr in arrays.items():
    path = tmp_path / f"{name}.npy"
    np.save(path, arr, allow_pickle=True)
    c = load_corpus(DataConfig(source="tokens", path=str(path), validation_fraction=0.2))
    got = [tuple(d) for t in (c.train_tokens, c.valid_tokens) for d in iter_documents(t, BOS)]
    assert sorted(got) == sorted(tuple(d) for d in expected[name]), name
    assert c.train_tokens.dtype == np.int32
  bad = tmp_path / "bad.npy"
  np.save(bad, np.array([1, 2, 300]))
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 257\)"):
    load_corpus(DataConfig(source="tokens", path=str(bad)))
  floats = tmp_path / "floats.npy"
  np.save(floats, np.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="integer token ids"):
    load_corpus(DataConfig(source="tokens", path=str(floats)))


def test_errors_name_the_setting(tmp_path):
  with pytest.raises(ValueError, match=r"DataConfig.path='.*nope' does not exist"):
    load_corpus(DataConfig(source="text", path=str(tmp_path / "nope")))
  with pytest.raises(ValueError, match="DataConfig.path is empty"):
    load_corpus(DataConfig(source="jsonl", path=""))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match=r"no data: DataConfig.path=.*empty"):
    load_corpus(DataConfig(source="text", path=str(empty)))
  (empty / "blank.txt").write_text("")
  with pytest.raises(ValueError, match="no non-empty document"):
    load_corpus(DataConfig(source="text", path=str(empty)))
  binary = tmp_path / "bin.txt"
  binary.write_bytes(b"\xff\xfe\x00bad")
  with pytest.raises(ValueError, match="not UTF-8"):
    load_corpus(DataConfig(source="text", path=str(binary)))
  with pytest.raises(ValueError, match="DataConfig.source='mqar' is a synthetic task"):
    load_corpus(DataConfig(source="mqar"))
  with pytest.raises(ValueError, match="no data: the builtin corpus with DataConfig.max_bytes=10"):
    load_corpus(DataConfig(max_bytes=10))


@pytest.mark.parametrize("name,pip_name", [("sentencepiece", "sentencepiece"),
                                           ("tiktoken", "tiktoken")])
def test_missing_optional_library_names_pip_package(monkeypatch, tmp_path, name, pip_name):
  model = tmp_path / "model.bin"
  model.write_bytes(b"x")
  monkeypatch.setitem(sys.modules, name, None)   # makes `import name` raise ImportError
  with pytest.raises(ValueError, match=f"pip install {pip_name}"):
    tokenizers.make_tokenizer(name, str(model))
  with pytest.raises(ValueError, match="DataConfig.tokenizer_path is empty"):
    tokenizers.make_tokenizer(name, "")


@pytest.fixture
def offline(monkeypatch):
  """No network: every name lookup and socket connection fails (the tokenizers read local model
  files only; a download would end the test with this AssertionError)."""
  def refuse(*args, **kwargs):
    raise AssertionError(f"network access attempted: {args!r}")
  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket.socket, "connect_ex", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


def test_tiktoken_local_file(tmp_path, monkeypatch, offline):
  # tiktoken and sentencepiece are test dependencies (setup.cfg's [test] extra): no skip.
  import base64
  import tiktoken  # noqa: F401
  # tiktoken copies a file it reads into its cache folder (default under the system temp
  # folder, keyed by the path): this test's own, empty at the start.
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))
  merges = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the"]
  path = tmp_path / "tiny.tiktoken"
  path.write_text("".join(f"{base64.b64encode(m).decode()} {r}\n" for r, m in enumerate(merges)))
  tok = tokenizers.make_tokenizer("tiktoken", str(path))
  assert tok.bos_id == 259 and tok.vocab_size == 260
  text = "the cat and the <|endoftext|> dog"
  ids = tok.encode(text)
  assert tok.bos_id not in ids and 258 in ids
  assert tok.decode(ids) == text
  f = tmp_path / "a.txt"
  f.write_text(text * 20)
  c = load_corpus(DataConfig(source="text", path=str(f), tokenizer="tiktoken",
                             tokenizer_path=str(path)))
  assert c.tokenizer.decode(c.train_tokens) + c.tokenizer.decode(c.valid_tokens) == text * 20


def test_sentencepiece_local_model(tmp_path, offline):
  import sentencepiece as spm
  corpus_file = tmp_path / "train.txt"
  corpus_file.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog"
                                   for i in range(300)))
  spm.SentencePieceTrainer.train(input=str(corpus_file), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=60, minloglevel=2)
  tok = tokenizers.make_tokenizer("sentencepiece", str(tmp_path / "sp.model"))
  assert tok.vocab_size == 60 and tok.bos_id == 1
  ids = tok.encode("the lazy fox")
  assert ids.dtype == np.int32 and tok.bos_id not in ids
  assert tok.decode(np.concatenate([[tok.bos_id], ids])) == "the lazy fox"

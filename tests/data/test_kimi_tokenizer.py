"""DataConfig.tokenizer='kimi': a tiny tiktoken.model and tokenizer_config.json written here, in
the release's layout; the pre-tokenisation keeps Han runs apart (cl100k's does not), special ids
come from added_tokens_decoder, BOS is its bos_token."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from k3jax.data import tokenizers

# The UTF-8 bytes of '中' are e4 b8 ad.
HAN = "中".encode()


@pytest.fixture
def kimi_files(tmp_path, monkeypatch):
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))
  merges = [bytes([i]) for i in range(256)] + [b"c" + HAN[:1], b"c" + HAN[:2], b"c" + HAN,
                                               HAN[:2], HAN]
  path = tmp_path / "tiktoken.model"
  path.write_text("".join(f"{base64.b64encode(m).decode()} {r}\n" for r, m in enumerate(merges)))
  base = len(merges)   # 261
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "[BOS]", "eos_token": "[EOS]",
      "added_tokens_decoder": {str(base): {"content": "[BOS]", "special": True},
                               str(base + 1): {"content": "[EOS]", "special": True},
                               str(base + 5): {"content": "<|im_end|>", "special": True}}}))
  return path


def test_kimi_pattern_keeps_han_runs_apart(kimi_files):
  kimi = tokenizers.make_tokenizer("kimi", str(kimi_files))
  cl100k = tokenizers.make_tokenizer("tiktoken", str(kimi_files))
  text = "abc中"
  # cl100k's \p{L}+ takes 'abc中' as one piece, so the rank for 'c中' merges across the script
  # boundary; Kimi's pattern splits 'abc' from '中', which then merges into its own token.
  assert cl100k.encode(text).tolist() == [ord("a"), ord("b"), 258]
  assert kimi.encode(text).tolist() == [ord("a"), ord("b"), ord("c"), 260]
  assert kimi.decode(kimi.encode("Hello 中文, it's 2026!")) == "Hello 中文, it's 2026!"


def test_kimi_special_tokens(kimi_files):
  kimi = tokenizers.make_tokenizer("kimi", str(kimi_files))
  assert kimi.bos_id == 261 and kimi.vocab_size == 267
  ids = kimi.encode("[BOS] <|im_end|>")          # special tokens in text stay text
  assert kimi.bos_id not in ids.tolist() and max(ids.tolist()) < 256
  assert kimi.decode(np.array([261, ord("x"), 262])) == "x[EOS]"


def test_kimi_needs_its_config(tmp_path, kimi_files):
  (kimi_files.parent / "tokenizer_config.json").unlink()
  with pytest.raises(ValueError, match="needs tokenizer_config.json beside"):
    tokenizers.make_tokenizer("kimi", str(kimi_files))

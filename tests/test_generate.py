"""Decoding: prefill + one-token steps reproduce the full forward pass; sampling basics."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax.config import ImplConfig
from k3jax.generate import describe_prompt
from k3jax.model import K3Model
from k3jax.model.decode import decode_forward, generate, init_cache, sample_token
from testlib import random_variables

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "gin_configs")
# The implementation settings every test decodes with (the defaults: the scanned layout where the
# decoder has whole groups).
IMPL = ImplConfig()


@functools.lru_cache(maxsize=None)
def _jitted_apply(cfg, impl=IMPL):
  """K3Model(cfg, impl).apply jitted once per config: the tests' full forwards of one shape share
  it."""
  return jax.jit(K3Model(cfg, impl).apply)


def _full_forward(cfg, variables, tokens):
  return _jitted_apply(cfg)(variables, tokens)


# The tests below decode 21 positions, with a prompt (prefill) of 13 where they prefill: they
# compile the same three programs (the 21-token full forward, the 13-token prefill and the
# one-token step against a 21-position cache), which the process or the persistent compilation
# cache then shares between them.
_LENGTH, _PREFILL = 21, 13


def _setup():
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")]).model
  cfg = dataclasses.replace(cfg, kda_chunk_size=16)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, _LENGTH), 0, cfg.vocab_size)
  return cfg, tokens, _variables(cfg)


@functools.lru_cache(maxsize=None)
def _variables(cfg):
  """Random variables of K3Model(cfg, IMPL) (testlib's `random_variables`: non-zero DepthMix
  queries and QB biases, so that the mixes are not uniform and routing depends on the bias), drawn
  in numpy: decoding must reproduce the full forward whatever the values, and the initialisers
  need no compile. Shared between tests: do not mutate."""
  return random_variables(cfg, IMPL, seed=0)


def test_prefill_then_steps_equal_full_forward():
  cfg, tokens, variables = _setup()
  full = _full_forward(cfg, variables, tokens)
  prefill_len = _PREFILL
  cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], IMPL)
  logits, cache = decode_forward(cfg, IMPL, variables, cache, tokens[:, :prefill_len])
  got = [logits]
  for t in range(prefill_len, tokens.shape[1]):
    logits, cache = decode_forward(cfg, IMPL, variables, cache, tokens[:, t:t + 1])
    got.append(logits)
  got = jnp.concatenate(got, axis=1)
  np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_token_by_token_from_the_start_equals_full_forward():
  cfg, tokens, variables = _setup()
  full = _full_forward(cfg, variables, tokens)
  cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], IMPL)
  got = []
  for t in range(tokens.shape[1]):
    logits, cache = decode_forward(cfg, IMPL, variables, cache, tokens[:, t:t + 1])
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generation_follows_the_argmax_of_the_full_forward():
  cfg, tokens, variables = _setup()
  prompt = tokens[:, :_PREFILL]
  out = generate(cfg, variables, prompt, _LENGTH - _PREFILL, jax.random.PRNGKey(0), impl=IMPL,
                 temperature=0.0)
  assert out.shape == (2, _LENGTH)
  np.testing.assert_array_equal(out[:, :_PREFILL], prompt)
  # The full forward of all 21 tokens (the model is causal: the logits at positions 12..19 are
  # those of the first 20 tokens alone, test_model's test_model_is_causal).
  full = _full_forward(cfg, variables, out)
  np.testing.assert_array_equal(out[:, _PREFILL:],
                                np.argmax(np.asarray(full[:, _PREFILL - 1:-1]), axis=-1))


def test_top_k_sampling_stays_in_the_top_k():
  logits = jnp.array([[0.0, 5.0, 4.0, -1.0, 3.0]])
  draws = [int(sample_token(jax.random.PRNGKey(i), logits, 1.0, 2)[0]) for i in range(50)]
  assert set(draws) <= {1, 2} and len(set(draws)) == 2


@pytest.mark.slow
def test_decoding_the_scanned_decoder_equals_its_full_forward():
  """With layers in the decoder's scan (6 layers, MLA every second: 0 | 1-2, 3-4 scanned | 5) the
  decode caches are stacked per group, and prefill + steps still give the full forward's logits."""
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")]).model
  cfg = dataclasses.replace(cfg, kda_chunk_size=16, num_layers=6, mla_every=2, d_model=32,
                            kda_head_dim=16, kda_value_dim=16, mla_kv_lora_rank=16,
                            mla_qk_nope_dim=16, mla_v_dim=16, dense_ffn_dim=32)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 11), 0, cfg.vocab_size)
  # Non-zero DepthMix queries (`_variables`), so that the mixes over the stacked blocks are not
  # uniform.
  variables = _variables(cfg)
  cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], IMPL)
  assert cache["scanned_period_2"]["layer_2"]["kda"]["kda_state"].shape[:2] == (2, 2)
  assert cache["scanned_period_2"]["layer_1"]["mla"]["cached_ckv"].shape == (2, 2, 11, 16)
  full = _full_forward(cfg, variables, tokens)
  logits, cache = decode_forward(cfg, IMPL, variables, cache, tokens[:, :7])
  got = [logits]
  for t in range(7, tokens.shape[1]):
    logits, cache = decode_forward(cfg, IMPL, variables, cache, tokens[:, t:t + 1])
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, rtol=1e-4, atol=1e-4)


def test_describe_prompt_shows_long_prompts_by_their_ends():
  short = "def f(x):\n  return x"
  assert describe_prompt(short) == "prompt:\n" + short       # text, newlines kept
  long = "".join(chr(ord("a") + i % 26) for i in range(1000))
  shown = describe_prompt(long, shown=100)
  assert shown.startswith("prompt (1,000 characters; the first and last 50 shown")
  assert long[:50] in shown and long[-50:] in shown and long[50:950] not in shown
  assert "[... 900 characters ...]" in shown
  assert describe_prompt(long, echo=True, shown=100) == "prompt:\n" + long

"""Block AttnRes: the depth mix against its formula, and zero-query equivalence with PreNorm."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ModelConfig
from k3jax.layers.attnres import DepthMix, attnres_block_boundaries
from k3jax.layers.common import rms_norm

EPS = 1e-6
CFG = dataclasses.replace(ModelConfig(), d_model=16, norm_eps=EPS)
KEY = jax.random.key(0, impl="rbg")  # threefry is slow to compile on CPU


def _sources(n, seed=0, shape=(2, 5, 16)):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(0, 1 + i, shape), jnp.float32) for i in range(n)]


def test_zero_query_is_uniform_mean():
  srcs = _sources(3)
  mix = DepthMix(CFG)
  params = nn.unbox(mix.init(KEY, srcs)["params"])
  np.testing.assert_array_equal(np.asarray(params["query"]), np.zeros(16))
  h = mix.apply({"params": params}, srcs)
  np.testing.assert_allclose(np.asarray(h), np.mean(np.stack(srcs), 0), rtol=1e-6, atol=1e-6)


def test_matches_formula_and_keeps_dtype():
  srcs = _sources(4, seed=1)
  w = np.random.default_rng(2).normal(0, 0.5, 16).astype(np.float32)
  h = DepthMix(CFG).apply({"params": {"query": jnp.asarray(w)}}, srcs)
  v = np.stack([np.asarray(s, np.float64) for s in srcs])                 # [S, B, T, d]
  keys = v / np.sqrt(np.mean(v**2, -1, keepdims=True) + EPS)              # no learned scale
  logits = keys @ w                                                       # no 1/sqrt(d)
  alpha = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
  np.testing.assert_allclose(np.asarray(h), np.einsum("sbt,sbtd->btd", alpha, v), rtol=1e-5,
                             atol=1e-5)
  h16 = DepthMix(CFG).apply({"params": {"query": jnp.asarray(w)}},
                            [s.astype(jnp.bfloat16) for s in srcs])
  assert h16.dtype == jnp.bfloat16


def test_key_norm_gain_scales_the_normed_keys():
  """attnres_key_norm_gain: scores <g ⊙ RMSNorm(s_i), q> (K3's *_res_norm.weight and
  *_res_proj.weight), checked by the formula in float64; the gain starts at one, and its gradient
  is q ⊙ Σ_i (∂L/∂score_i) RMSNorm(s_i), not zero, once q is."""
  cfg = dataclasses.replace(CFG, attnres_key_norm_gain=True)
  srcs = _sources(3, seed=3)
  params = nn.unbox(DepthMix(cfg).init(KEY, srcs)["params"])
  np.testing.assert_array_equal(np.asarray(params["key_norm_gain"]), np.ones(16))
  rng = np.random.default_rng(4)
  w = rng.normal(0, 0.5, 16).astype(np.float32)
  g = rng.normal(1, 0.5, 16).astype(np.float32)
  variables = {"params": {"query": jnp.asarray(w), "key_norm_gain": jnp.asarray(g)}}
  h = DepthMix(cfg).apply(variables, srcs)
  v = np.stack([np.asarray(s, np.float64) for s in srcs])
  keys = v / np.sqrt(np.mean(v**2, -1, keepdims=True) + EPS) * g
  logits = keys @ w
  alpha = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
  np.testing.assert_allclose(np.asarray(h), np.einsum("sbt,sbtd->btd", alpha, v), rtol=1e-5,
                             atol=1e-5)
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(DepthMix(cfg).apply({"params": p}, srcs))))(
      variables["params"])
  assert float(jnp.max(jnp.abs(grads["key_norm_gain"]))) > 1e-3


def test_rejects_bad_sources():
  with pytest.raises(ValueError, match="non-empty"):
    DepthMix(CFG).init(KEY, [])
  with pytest.raises(ValueError, match="source 1"):
    DepthMix(CFG).init(KEY, [jnp.zeros((1, 2, 16)), jnp.zeros((1, 3, 16))])


def test_block_boundaries():
  assert attnres_block_boundaries(93, 12) == tuple(range(0, 85, 12))   # K3: 8 frozen blocks
  assert attnres_block_boundaries(4, 2) == (0, 2)
  assert attnres_block_boundaries(5, 8) == (0,)
  with pytest.raises(ValueError, match="block_size"):
    attnres_block_boundaries(4, 0)


# A toy decoder: sublayer f(u) = tanh(u W) on u = rms_norm(input), two per layer.

class ToyAttnRes(nn.Module):
  """The wiring documented in k3jax/layers/attnres.py, with toy sublayers."""
  num_layers: int
  block_size: int

  @nn.compact
  def __call__(self, emb, weights):
    blocks, partial = [], emb
    boundaries = attnres_block_boundaries(self.num_layers, self.block_size)
    for i in range(self.num_layers):
      if i in boundaries:
        blocks.append(partial)
        partial = None
      for j in range(2):
        sources = blocks + ([partial] if partial is not None else [])
        h = DepthMix(CFG, name=f"mix_{i}_{j}")(sources)
        out = jnp.tanh(rms_norm(h, EPS) @ weights[2 * i + j])
        partial = out if partial is None else partial + out
    h = DepthMix(CFG, name="mix_final")(blocks + [partial])
    return rms_norm(h, EPS)


def _prenorm(emb, weights):
  x = emb
  for w in weights:
    x = x + jnp.tanh(rms_norm(x, EPS) @ w)
  return rms_norm(x, EPS)


@pytest.mark.parametrize("num_layers,block_size", [(5, 2), (4, 1), (3, 8)])
def test_zero_queries_equal_prenorm_network(num_layers, block_size):
  rng = np.random.default_rng(3)
  emb = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)
  weights = jnp.asarray(rng.normal(0, 0.5, (2 * num_layers, 16, 16)), jnp.float32)
  net = ToyAttnRes(num_layers, block_size)
  params = nn.unbox(jax.jit(net.init)(KEY, emb, weights)["params"])
  assert len(params) == 2 * num_layers + 1
  out = jax.jit(net.apply)({"params": params}, emb, weights)
  # Equal up to the norm epsilon (the mean is a scaled residual sum; RMSNorm ignores scale).
  np.testing.assert_allclose(np.asarray(out), np.asarray(_prenorm(emb, weights)), rtol=1e-4,
                             atol=1e-4)

  # Gradients reach every pseudo-query, and agree with a finite difference.
  @jax.jit
  def loss(p):
    return jnp.sum(net.apply({"params": p}, emb, weights) * emb)

  grads = jax.jit(jax.grad(loss))(params)
  for name, g in grads.items():
    g = np.asarray(g["query"])
    # The very first mix has a single source (the embedding): softmax over one item is constant.
    if name == "mix_0_0":
      np.testing.assert_array_equal(g, np.zeros(16))
    else:
      assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-4, name
  name = "mix_final"
  direction = np.random.default_rng(4).normal(size=16).astype(np.float32)
  delta = 1e-2
  bumped = {**params, name: {"query": params[name]["query"] + delta * direction}}
  dropped = {**params, name: {"query": params[name]["query"] - delta * direction}}
  fd = (float(loss(bumped)) - float(loss(dropped))) / (2 * delta)
  np.testing.assert_allclose(float(np.asarray(grads[name]["query"]) @ direction), fd, rtol=2e-2,
                             atol=1e-3)

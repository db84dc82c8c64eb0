"""SiTU-GLU: closed-form properties and the layer against a numpy computation of the formula."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import ModelConfig
from k3jax.layers.ffn import SiTUGLU
from k3jax.ops.situ_glu import situ, situ_glu, softcap


def _np_situ_glu(a, b, beta1=4.0, beta2=25.0):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return beta1 * np.tanh(a / beta1) / (1 + np.exp(-a)) * beta2 * np.tanh(b / beta2)


def test_bounded_by_beta1_beta2_for_huge_inputs():
  rng = np.random.default_rng(0)
  gate = jnp.asarray(rng.normal(0, 1e4, (4096,)), jnp.float32)
  up = jnp.asarray(rng.normal(0, 1e4, (4096,)), jnp.float32)
  h = situ_glu(gate, up, 4.0, 25.0)
  assert bool(jnp.all(jnp.isfinite(h)))
  assert float(jnp.max(jnp.abs(h))) <= 100.0
  # The bound is tight: large positive gate and large |up| approach ±100.
  corner = situ_glu(jnp.array([1e4, 1e4]), jnp.array([1e4, -1e4]))
  np.testing.assert_allclose(np.asarray(corner), [100.0, -100.0], rtol=1e-6)
  # Large negative gates switch the unit off.
  assert abs(float(situ(jnp.array(-1e4)))) < 1e-30


def test_equals_swiglu_near_zero():
  rng = np.random.default_rng(1)
  a = rng.uniform(-0.1, 0.1, (1000,)).astype(np.float32)
  b = rng.uniform(-0.1, 0.1, (1000,)).astype(np.float32)
  h = np.asarray(situ_glu(jnp.asarray(a), jnp.asarray(b)), np.float64)
  swiglu = a / (1 + np.exp(-a.astype(np.float64))) * b
  rel = np.abs(h - swiglu) / np.maximum(np.abs(swiglu), 1e-12)
  # tanh(x/β)·β = x(1 − x²/3β² + …): relative error ≲ a²/48 + b²/1875 ≈ 2e-4 here.
  assert rel.max() < 5e-4, rel.max()
  # and the formula itself, in fp32, against float64
  np.testing.assert_allclose(h, _np_situ_glu(a, b), rtol=1e-5, atol=1e-9)


def test_softcap_and_situ_closed_forms():
  x = jnp.array([-50.0, -1.0, 0.0, 0.5, 30.0])
  np.testing.assert_allclose(np.asarray(softcap(x, 25.0)), 25 * np.tanh(np.asarray(x) / 25),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(situ(x, 4.0)),
                             4 * np.tanh(np.asarray(x) / 4) / (1 + np.exp(-np.asarray(x))),
                             rtol=1e-6, atol=1e-12)


def test_situ_glu_rejects_bad_input():
  with pytest.raises(ValueError, match="gate shape"):
    situ_glu(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="beta1"):
    situ_glu(jnp.zeros(3), jnp.zeros(3), beta1=0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_matches_numpy(dtype):
  cfg = dataclasses.replace(ModelConfig(), dtype=dtype, init_std=0.3, situ_beta1=3.0,
                            situ_beta2=7.0)
  layer = SiTUGLU(cfg, hidden_dim=24)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
  # An rbg key: the default threefry PRNG is slow to compile on CPU.
  params = nn.unbox(jax.jit(layer.init)(jax.random.key(1, impl="rbg"), x)["params"])
  y = layer.apply({"params": params}, x)
  assert y.shape == (2, 5, 16) and y.dtype == jnp.dtype(dtype)
  xn = np.asarray(x, np.float64)
  wg, wu, wo = (np.asarray(params[n]["kernel"], np.float64) for n in ("gate", "up", "out"))
  ref = _np_situ_glu(xn @ wg, xn @ wu, 3.0, 7.0) @ wo
  tol = 1e-5 if dtype == "float32" else 5e-2
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=tol, atol=tol)
  assert params["gate"]["kernel"].shape == (16, 24) and params["out"]["kernel"].shape == (24, 16)


def test_swiglu_layer_matches_numpy():
  """ffn_activation='swiglu': W_out(silu(W_gate x) ⊙ W_up x), with the same parameters as SiTU-GLU
  (the betas are ignored); large weights so that SiTU-GLU's bounds would show."""
  cfg = dataclasses.replace(ModelConfig(), ffn_activation="swiglu", init_std=1.0)
  layer = SiTUGLU(cfg, hidden_dim=24)
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, 16)), jnp.float32)
  params = nn.unbox(jax.jit(layer.init)(jax.random.key(1, impl="rbg"), x)["params"])
  y = np.asarray(layer.apply({"params": params}, x), np.float64)
  xn = np.asarray(x, np.float64)
  wg, wu, wo = (np.asarray(params[n]["kernel"], np.float64) for n in ("gate", "up", "out"))
  a, b = xn @ wg, xn @ wu
  np.testing.assert_allclose(y, (a / (1 + np.exp(-a)) * b) @ wo, rtol=1e-5, atol=1e-4)
  situ_cfg = dataclasses.replace(cfg, ffn_activation="situ_glu")
  bounded = np.asarray(SiTUGLU(situ_cfg, hidden_dim=24).apply({"params": params}, x))
  assert np.max(np.abs(bounded - y)) > 1.0


def test_chunked_layer_equals_unchunked():
  """chunk_tokens (ImplConfig.position_chunk_tokens): values and gradients (params and input)
  equal the whole-sequence layer, with T not a multiple of the chunk; the parameters are the same
  tree."""
  cfg = dataclasses.replace(ModelConfig(), init_std=0.3)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 11, 16)), jnp.float32)
  whole = SiTUGLU(cfg, hidden_dim=24)
  chunked = SiTUGLU(cfg, hidden_dim=24, chunk_tokens=6)
  params = nn.unbox(jax.jit(whole.init)(jax.random.key(1, impl="rbg"), x)["params"])
  shapes = jax.eval_shape(chunked.init, jax.random.key(1, impl="rbg"), x)["params"]
  assert jax.tree.structure(nn.unbox(shapes)) == jax.tree.structure(params)

  def loss(layer):
    return jax.jit(jax.value_and_grad(
        lambda p, x: jnp.sum(jnp.sin(layer.apply({"params": p}, x))), argnums=(0, 1)))

  want, got = loss(whole)(params, x), loss(chunked)(params, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(chunked.apply({"params": params}, x),
                             whole.apply({"params": params}, x), rtol=1e-6, atol=1e-6)


def test_kernel_is_stored_like_dense():
  """`Kernel` (used so that the chunked GLU can map a pure function) keeps its weight where and
  as `common.Dense` did: same path and the same initial values, so checkpoints carry over."""
  from k3jax.layers import common
  from k3jax.layers.ffn import Kernel

  class WithDense(nn.Module):
    @nn.compact
    def __call__(self, x):
      return common.Dense(7, axes=("embed", "mlp"), init_std=0.5, name="gate")(x)

  class WithKernel(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x @ Kernel((x.shape[-1], 7), ("embed", "mlp"), 0.5, name="gate")()

  x = jnp.ones((3, 5))
  key = jax.random.key(4, impl="rbg")
  a = jax.jit(WithDense().init)(key, x)["params"]
  b = jax.jit(WithKernel().init)(key, x)["params"]
  assert a["gate"]["kernel"].names == b["gate"]["kernel"].names == ("embed", "mlp")
  np.testing.assert_array_equal(np.asarray(nn.unbox(a)["gate"]["kernel"]),
                                np.asarray(nn.unbox(b)["gate"]["kernel"]))

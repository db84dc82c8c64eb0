"""situ_glu's custom VJP: values and gradients against jax.grad of a plain fp32 formulation, and the
residuals it keeps for the backward (gate and up in their own dtypes, nothing in fp32 for bf16)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.situ_glu import situ_glu

# (beta1, beta2): K3's defaults and two other pairs, small enough that the saturation points below
# are deep in the flat part of both tanh's.
BETAS = [(4.0, 25.0), (2.5, 7.0), (1.0, 3.0)]


def _plain_situ_glu(gate: jax.Array, up: jax.Array, beta1: float, beta2: float) -> jax.Array:
  """The straightforward fp32 expression, written without k3jax: sigmoid as (1 + tanh(a/2))/2
  (stable for any |a|, and a different path from jax.nn.sigmoid). Returns fp32 [..., m]."""
  a = gate.astype(jnp.float32)
  b = up.astype(jnp.float32)
  sigmoid_a = 0.5 * (1.0 + jnp.tanh(0.5 * a))
  return beta1 * jnp.tanh(a / beta1) * sigmoid_a * (beta2 * jnp.tanh(b / beta2))


def _inputs(seed: int, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
  """gate, up [6, 40] with ordinary values (N(0, 3)) and saturating corners (±50 in each of gate
  and up, alone and together); a cotangent dh [6, 40] ~ N(0, 1). All in `dtype`."""
  rng = np.random.default_rng(seed)
  gate = rng.normal(0.0, 3.0, (6, 40))
  up = rng.normal(0.0, 3.0, (6, 40))
  corners = np.array([(50.0, 50.0), (50.0, -50.0), (-50.0, 50.0), (-50.0, -50.0),
                      (50.0, 1.5), (-50.0, 1.5), (1.5, 50.0), (1.5, -50.0), (0.0, 0.0)])
  gate[0, :len(corners)] = corners[:, 0]
  up[0, :len(corners)] = corners[:, 1]
  dh = rng.normal(0.0, 1.0, (6, 40))
  return tuple(jnp.asarray(x, dtype) for x in (gate, up, dh))


def _assert_close_fp32(x: jax.Array, y: jax.Array, name: str) -> None:
  """fp32 agreement to ~1e-6. Near saturation 1 − tanh² cancels, in both formulations: each is off
  the float64 value by ~1e-7 of the array's largest entry there, so atol scales with that entry."""
  scale = float(jnp.max(jnp.abs(y)))
  np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-6 * scale,
                             err_msg=name)


def _grads(fn, gate, up, dh):
  """(h, dgate, dup): fn's value and the VJP of dh, h in fn's output dtype."""
  h, vjp = jax.vjp(fn, gate, up)
  return (h, *vjp(dh.astype(h.dtype)))


@pytest.mark.parametrize("beta1,beta2", BETAS)
def test_fp32_values_and_gradients_match_plain_autodiff(beta1, beta2):
  gate, up, dh = _inputs(0, jnp.float32)
  got = _grads(lambda g, u: situ_glu(g, u, beta1, beta2), gate, up, dh)
  want = _grads(lambda g, u: _plain_situ_glu(g, u, beta1, beta2), gate, up, dh)
  for name, x, y in zip(("h", "dgate", "dup"), got, want):
    assert x.dtype == jnp.float32, name
    assert bool(jnp.all(jnp.isfinite(x))), name
    _assert_close_fp32(x, y, name)
  # Where gate = ±50 (tanh(a/β1) and sigmoid flat) the gate gradient vanishes; at gate = 1.5 and
  # at up = 1.5 the gradients are far from 0, so the corners are not trivially equal.
  dgate, dup = np.asarray(got[1])[0], np.asarray(got[2])[0]
  assert np.all(np.abs(dgate[:6]) < 1e-6), dgate[:6]
  assert abs(dup[4]) > 1e-3 and np.all(np.abs(dgate[6:8]) > 1e-3), (dup[4], dgate[6:8])


@pytest.mark.parametrize("beta1,beta2", BETAS)
def test_bf16_values_and_gradients_match_plain_autodiff(beta1, beta2):
  gate, up, dh = _inputs(1, jnp.bfloat16)
  got = _grads(lambda g, u: situ_glu(g, u, beta1, beta2), gate, up, dh)
  # The plain expression is fp32 throughout; the bf16 cast of its output is what situ_glu returns.
  want = _grads(lambda g, u: _plain_situ_glu(g, u, beta1, beta2).astype(jnp.bfloat16), gate, up,
                dh)
  for name, x, y in zip(("h", "dgate", "dup"), got, want):
    assert x.dtype == jnp.bfloat16, name
    # Both round the same fp32 result to bf16 once; fp32 rounding differences may flip one ulp.
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=2 ** -7, atol=1e-6, err_msg=name)


def test_mixed_dtypes_give_each_gradient_its_input_dtype():
  gate, up, dh = _inputs(2, jnp.float32)
  gate = gate.astype(jnp.bfloat16)
  h, dgate, dup = _grads(lambda g, u: situ_glu(g, u, 2.5, 7.0), gate, up, dh)
  _, want_dgate, want_dup = _grads(lambda g, u: _plain_situ_glu(g, u, 2.5, 7.0), gate, up, dh)
  assert (h.dtype, dgate.dtype, dup.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
  _assert_close_fp32(dup, want_dup, "dup")
  np.testing.assert_allclose(np.asarray(dgate, np.float32), np.asarray(want_dgate, np.float32),
                             rtol=2 ** -7, atol=1e-6)


def test_gradient_under_jit_and_vmap():
  gate, up, dh = _inputs(3, jnp.float32)

  def loss(fn, g, u):
    return jnp.sum(jax.vmap(fn)(g, u) * dh)

  got = jax.jit(jax.grad(lambda g, u: loss(situ_glu, g, u), argnums=(0, 1)))(gate, up)
  want = jax.grad(lambda g, u: loss(lambda x, y: _plain_situ_glu(x, y, 4.0, 25.0), g, u),
                  argnums=(0, 1))(gate, up)
  for name, x, y in zip(("dgate", "dup"), got, want):
    _assert_close_fp32(x, y, name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("jit", [False, True])
def test_backward_keeps_only_gate_and_up_in_their_dtype(jit, dtype):
  """What the VJP closure holds is what a training step keeps alive from forward to backward.
  Autodiff of the fp32 expression kept seven fp32 [6, 40] arrays here (tanh, sigmoid, products)
  for either input dtype; now bf16 inputs leave no fp32 array."""
  gate, up, _ = _inputs(4, dtype)

  def residuals(g, u):
    return jax.vjp(lambda x, y: situ_glu(x, y, 2.5, 7.0), g, u)[1]

  vjp_fn = (jax.jit(residuals) if jit else residuals)(gate, up)
  held = [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(vjp_fn)]
  assert held == [(jnp.dtype(dtype), (6, 40))] * 2, held


def test_rejects_bad_input():
  with pytest.raises(ValueError, match="gate shape"):
    situ_glu(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="beta1=4.0 and beta2=0.0"):
    situ_glu(jnp.zeros(3), jnp.zeros(3), beta2=0.0)
  with pytest.raises(ValueError, match="up must have a floating dtype"):
    situ_glu(jnp.zeros(3), jnp.zeros(3, jnp.int32))


def test_compiled_gradient_recomputes_instead_of_keeping_the_forward_intermediates():
  """In one jitted value-and-gradient (a training step), XLA's common-subexpression elimination
  merged the backward's recomputed tanh(a/β1) and tanh(b/β2) with the forward's: the forward then
  wrote both fp32 arrays out for the backward (12.2 GiB a step on small.gin). With the backward's
  residuals behind an optimization barrier the compiled program computes each tanh twice."""
  gate, up, _ = _inputs(5, jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(5).normal(size=(40, 8)), jnp.bfloat16)

  def loss(g, u, w):
    h = situ_glu(g, u, 2.5, 7.0)
    return jnp.sum(jnp.square((h @ w).astype(jnp.float32)))

  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(gate, up, w).compile().as_text()
  tanh_ops = re.findall(r"= f32\[[\d,]*\](?:\{[\d,]*\})? tanh\(", hlo)
  assert len(tanh_ops) == 4, hlo


def test_swiglu_values_and_gradients_match_plain_autodiff():
  """beta1 = beta2 = None is SwiGLU: silu(gate)·up and its autodiff gradient, written plainly."""
  gate, up, dh = _inputs(5, jnp.float32)

  def plain(g, u):
    return g * (0.5 * (1.0 + jnp.tanh(0.5 * g))) * u

  got = _grads(lambda g, u: situ_glu(g, u, None, None), gate, up, dh)
  want = _grads(plain, gate, up, dh)
  for name, x, y in zip(("h", "dgate", "dup"), got, want):
    assert bool(jnp.all(jnp.isfinite(x))), name
    _assert_close_fp32(x, y, name)
  # Unbounded: at gate = up = 50, h = 2500 (SiTU-GLU with K3's betas stays below 100).
  assert float(got[0][0, 0]) == pytest.approx(2500.0, rel=1e-6)
